"""The cold path: ``.bin`` objects, the object store, the segment uploader, the cloud reader
and the WAL cleaner."""
