"""--log-json: one JSON object per line, with the fields a call passed through ``extra``."""

from __future__ import annotations

import json
import logging

from splitspec.cli.logs import JsonFormatter


def test_json_line_carries_message_extras_and_traceback():
    formatter = JsonFormatter()
    record = logging.LogRecord("splitspec.x", logging.INFO, __file__, 1, "request %s done", ("abc",), None)
    record.request = {"request_id": "abc", "steps": 3}
    line = json.loads(formatter.format(record))
    assert line["message"] == "request abc done" and line["level"] == "info" and line["logger"] == "splitspec.x"
    assert line["request"] == {"request_id": "abc", "steps": 3}
    assert line["time"].endswith("+00:00")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        failed = logging.LogRecord("splitspec.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    entry = json.loads(formatter.format(failed))
    assert "ValueError: boom" in entry["exception"] and "\n" not in formatter.format(failed)
