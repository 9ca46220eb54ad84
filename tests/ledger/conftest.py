import json

import pytest

from otel_llm import usage


@pytest.fixture
def write_spool(tmp_path):
    """write_spool(records): a spool directory holding the records (dicts), one JSON line each."""

    def write(records, name="spool"):
        spool = usage.Spool(str(tmp_path / name), fsync_interval_s=0)
        for rec in records:
            spool.write(json.dumps(rec).encode() + b"\n")
        spool.close()
        return tmp_path / name

    return write
