"""The Helm chart: every rendered container's command line is accepted by the real CLI it runs, and the
topic-creation hook script works against the real broker (helpers: helm_helpers.py)."""
from __future__ import annotations

import argparse
import importlib.util
import uuid

import pytest

from helm_helpers import CHART, VALUE_SETS, containers, _parse, render, rendered, with_values, workloads

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------ the flags exist in the real CLIs
def _agent_parser() -> argparse.ArgumentParser:
    from stepwatch.agents.commands import register
    p = argparse.ArgumentParser(prog="stepwatch")
    register(p.add_subparsers(dest="cmd"))
    return p


def _subcommands(p: argparse.ArgumentParser) -> set[str]:
    return {n for a in p._actions if isinstance(a, argparse._SubParsersAction) for n in a.choices}


def test_the_stepwatch_command_has_the_agent_subcommand():
    # the chart's DaemonSet runs `stepwatch agent`
    from stepwatch.cli import build_parser
    assert "agent" in _subcommands(build_parser())


def _topics_parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("create_topics", CHART / "files" / "create-topics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.parser()



@pytest.mark.parametrize("name", list(VALUE_SETS) + ["provision-job"])
def test_rendered_commands_parse_with_the_real_clis(name):
    """Every container's command line is accepted by the parser of the command it runs."""
    from stepwatch.cli import build_parser
    if name == "provision-job":
        objs, _ = render(with_values(**{"grafana.url": "http://g:3000", "grafana.tokenSecret": {"name": "t", "key": "token"},
                                        "grafana.provisionJob": {"enabled": True, "alertRules": False}}))
    else:
        objs = rendered(name)
    seen = set()
    for w in workloads(objs):
        for c in containers(w):
            cmd = c["command"]
            if cmd[0] == "sh":
                continue
            if cmd[0] == "python":
                assert cmd[1] == "/etc/stepwatch/scripts/create-topics.py"
                _parse(_topics_parser(), c["args"])
                seen.add("create-topics")
                continue
            assert cmd == ["stepwatch"]
            sub = c["args"][0]
            parser = build_parser()
            if sub == "agent" and sub not in _subcommands(parser):
                parser = _agent_parser()          # until stepwatch/cli.py registers agents.cli (see below)
            a = _parse(parser, c["args"])
            seen.add(sub)
            if sub == "process":
                assert a.group == "stepwatch-processor" and a.metrics_port == 9108
            if sub == "agent":
                assert a.socket_dir == "/run/stepwatch" and a.metrics_port == 9109
                if name == "ascend-profiling":
                    assert (a.profile_dir, a.profile_keep_mb, a.profile_cooldown, a.profile_max_steps) == \
                        ("/data/stepwatch/traces", 1024.0, 120.0, 50)
    assert seen >= {"process"} | ({"agent"} if name != "provision-job" else set())


def test_create_topics_script_against_the_broker(broker):
    """The hook Job's script, run for real: creates the ten topics with the configured partitions,
    then finds them all there on the next run (pre-upgrade)."""
    from kafka import KafkaConsumer
    spec = importlib.util.spec_from_file_location("create_topics", CHART / "files" / "create-topics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prefix = f"helm{uuid.uuid4().hex[:6]}."
    args = ["--bootstrap", broker.bootstrap, "--topic-prefix", prefix, "--partitions", "3",
            "--replication-factor", "1", "--partitions-by-topic", '{"steps": 5}']
    assert mod.main(args) == 0
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap)
    try:
        topics = {t for t in c.topics() if t.startswith(prefix)}
        assert len(topics) == 10                                      # (inflight: issue 18)
        assert len(c.partitions_for_topic(prefix + "steps")) == 5
        assert len(c.partitions_for_topic(prefix + "alerts")) == 3
    finally:
        c.close()
    assert mod.main(args) == 0                                        # idempotent
    assert mod.main(args + ["--partitions-by-topic", '{"stepz": 2}']) == 2
