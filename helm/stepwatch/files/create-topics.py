"""Create the missing stepwatch topics (the chart's pre-install/pre-upgrade hook Job runs this).

Connection settings come from the same flags and STEPWATCH_* environment as every stepwatch command
(``stepwatch.kafkaio.add_kafka_args``; the SASL password from STEPWATCH_KAFKA_PASSWORD_FILE).
Existing topics are left as they are (a partition count is never changed here). Exits non-zero,
naming the topic and Kafka's error, when a topic cannot be created.
"""
import argparse
import json
import sys

from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import TopicAlreadyExistsError

from stepwatch.kafkaio import TOPIC_NAMES, add_kafka_args, settings_from_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="create-topics")
    add_kafka_args(p)
    p.add_argument("--replication-factor", type=int, default=3)
    p.add_argument("--partitions-by-topic", default="{}", help="JSON object: topic name (no prefix) -> partitions")
    p.add_argument("--topic-config", default="{}", help="JSON object of topic configs for created topics")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    s = settings_from_args(a)
    per_topic = json.loads(a.partitions_by_topic)
    unknown = sorted(set(per_topic) - set(TOPIC_NAMES))
    if unknown:
        print(f"create-topics: unknown topic(s) {', '.join(unknown)}; known: {', '.join(TOPIC_NAMES)}",
              file=sys.stderr)
        return 2
    configs = {k: str(v) for k, v in json.loads(a.topic_config).items()}
    admin = KafkaAdminClient(**s.client_config())
    try:
        have = set(admin.list_topics())
        want = [NewTopic(s.topic(n), int(per_topic.get(n, a.partitions)), a.replication_factor,
                         topic_configs=configs) for n in TOPIC_NAMES if s.topic(n) not in have]
        for n in TOPIC_NAMES:
            if s.topic(n) in have:
                print(f"exists  {s.topic(n)}")
        failed = 0
        for t in want:      # one at a time: a failure names its topic
            try:
                admin.create_topics([t])
                print(f"created {t.name} (partitions {t.num_partitions}, replication {t.replication_factor})")
            except TopicAlreadyExistsError:
                print(f"exists  {t.name}")
            except Exception as e:  # noqa: BLE001 - report every topic, then fail
                failed += 1
                print(f"FAILED  {t.name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1 if failed else 0
    finally:
        admin.close()


if __name__ == "__main__":
    sys.exit(main())
