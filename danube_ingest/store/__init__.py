"""The topic store: topics over region logs, with a cache and readers."""

from danube_ingest.store.cache import WALCache
from danube_ingest.store.topic_store import TopicInfo, TopicReader, TopicStore

__all__ = ["TopicInfo", "TopicReader", "TopicStore", "WALCache"]
