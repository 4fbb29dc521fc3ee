"""Issue 16, all boundaries at once (CI size of ``stepwatch bench hostile``): hostile Kafka messages of
every kind (10 of each of the 29) interleaved with good data from producers using each codec, through
the real broker into a real ``stepwatch process``, while a real ``stepwatch agent`` serves a real probe
under a flood of hostile datagrams and unverifiable control commands. DuckDB must then find every
good row stored once under its own job and every bad message in the deadletter table once; the
processor ran to its idle exit and the agent was alive to the end, having refused every command."""
from __future__ import annotations

from types import SimpleNamespace

from stepwatch.devtools.hostile import KINDS, run_hostile_bench

import pytest
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_hostile_stream_through_the_real_broker_processor_and_agent(tmp_path, capsys):
    # the processor's idle exit: the stream is pre-sent and the agent ships a host sample every 0.2 s
    # until its leg ends, so 8 s without a message means everything was read (the bench waits 30 s)
    rc = run_hostile_bench(SimpleNamespace(messages=10 * KINDS, data_dir=str(tmp_path), idle_exit=8))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "OK:" in out and "agent alive" in out, out
