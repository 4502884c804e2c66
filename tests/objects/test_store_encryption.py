"""Server-side encryption of objects on s3 (``storage.cloud.options`` passed to opendal),
checked on what moto_server recorded for each PUT."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from danube_ingest.config import BrokerConfig, load_config
from danube_ingest.errors import ConfigError, DanubeIngestError
from danube_ingest.objects.store import ObjectStore
from danube_ingest.testing import MotoServer

KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/danube-test"


def s3_config(server: MotoServer, bucket: str, root: str, options: dict[str, str]) -> BrokerConfig:
    return load_config(
        None,
        {
            "storage.cloud.backend": "s3",
            "storage.cloud.bucket": bucket,
            "storage.cloud.endpoint": server.endpoint,
            "storage.cloud.region": server.region,
            "storage.cloud.access_key_id": server.access_key_id,
            "storage.cloud.secret_access_key": server.secret_access_key,
            "storage.cloud.root": root,
            "storage.cloud.options": options,
        },
    )


def boto(server: MotoServer) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name=server.region,
        aws_access_key_id=server.access_key_id,
        aws_secret_access_key=server.secret_access_key,
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"server_side_encryption": "AES256"}, {"ServerSideEncryption": "AES256"}),
        (
            {
                "server_side_encryption": "aws:kms",
                "server_side_encryption_aws_kms_key_id": KMS_KEY,
            },
            {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": KMS_KEY},
        ),
    ],
    ids=["sse-s3", "sse-kms"],
)
async def test_puts_carry_server_side_encryption(
    s3_server: MotoServer, s3_bucket: str, options: dict[str, str], expected: dict[str, str]
) -> None:
    root = f"/sse-{uuid.uuid4().hex[:12]}"
    store = ObjectStore.from_config(s3_config(s3_server, s3_bucket, root, options))
    try:
        await store.put("segments/small.bin", b"small")
        await store.put_large("segments/large.bin", [os.urandom(6 * 1024 * 1024)])
        assert await store.get("segments/small.bin") == b"small"
    finally:
        await store.close()
    client = boto(s3_server)
    for key in ("small.bin", "large.bin"):
        head = client.head_object(Bucket=s3_bucket, Key=f"{root.strip('/')}/segments/{key}")
        assert {name: head.get(name) for name in expected} == expected, key


async def test_customer_key_round_trip_and_never_shows(
    s3_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    """SSE-C: the key goes with every PUT and GET (moto does not record it, so only the round
    trip is checked here) and is scrubbed from descriptions and errors like a secret."""
    key = os.urandom(32)
    encoded = base64.b64encode(key).decode()
    options = {
        "server_side_encryption_customer_algorithm": "AES256",
        "server_side_encryption_customer_key": encoded,
        "server_side_encryption_customer_key_md5": base64.b64encode(
            hashlib.md5(key).digest()
        ).decode(),
    }
    root = f"/ssec-{uuid.uuid4().hex[:12]}"
    store = ObjectStore.from_config(s3_config(s3_server, s3_bucket, root, options))
    try:
        await store.put("o.bin", b"customer-encrypted")
        assert await store.get("o.bin") == b"customer-encrypted"
        assert encoded not in store.description
        with pytest.raises(DanubeIngestError) as info:
            await store.get("missing.bin")
        assert encoded not in str(info.value)
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"server_side_encryption": "AES-256"}, ""),
        ({"server_side_encryption_aws_kms_key_id": KMS_KEY}, "_aws_kms_key_id"),
        (
            {"server_side_encryption": "AES256", "server_side_encryption_aws_kms_key_id": KMS_KEY},
            "_aws_kms_key_id",
        ),
        ({"server_side_encryption_customer_key": "a2V5"}, "_customer_algorithm"),
        ({"server_side_encryption_customer_algorithm": "AES256"}, "_customer_key"),
    ],
)
def test_encryption_options_s3_would_refuse_or_ignore_are_config_errors(
    options: dict[str, str], key: str
) -> None:
    """moto accepts any value; S3 refuses a bad mode only at the first PUT (the uploader then
    retries for ever) and silently ignores a KMS key without aws:kms."""
    expected = re.escape(f"storage.cloud.options.server_side_encryption{key}:")
    with pytest.raises(ConfigError, match=expected):
        load_config(
            None,
            {
                "storage.cloud.backend": "s3",
                "storage.cloud.bucket": "b",
                "storage.cloud.region": "us-east-1",
                "storage.cloud.options": options,
            },
        )
