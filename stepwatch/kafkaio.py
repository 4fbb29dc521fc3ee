"""Kafka plumbing shared by every component: settings, topics, producers, consumers.

Secrets (SASL password) come only from the environment or a file, never from a command-line value,
and are never logged. Settings that matter against the embedded Tansu broker (docs/broker.md): a short
consumer session timeout (group join takes about session_timeout/2; 6 s unless
``STEPWATCH_KAFKA_SESSION_TIMEOUT_MS`` or ``--session-timeout-ms`` says otherwise), large fetch sizes for Arrow
batches, and no ``end_offsets`` calls (wrong on Tansu: lag is computed from ``highwater()``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from stepwatch.wire import catalog
from stepwatch.wire.catalog import ARROW_CT, headers   # (no pyarrow here: the node agent, which imports this
                                                       # module, sends nanoarrow's batches; stepwatch.wire.lite)

TOPIC_NAMES = catalog.TOPICS

#: the consumer group session timeout: a member silent this long is dropped and its partitions move on
SESSION_TIMEOUT_ENV = "STEPWATCH_KAFKA_SESSION_TIMEOUT_MS"


def session_timeout_ms(value: str | int | None = None) -> int:
    """The consumer group session timeout in ms: ``value``, else ``STEPWATCH_KAFKA_SESSION_TIMEOUT_MS``,
    else 6000 (a group join on the embedded broker takes about half of it: docs/broker.md). 1000 .. 300000."""
    raw = value if value is not None else os.environ.get(SESSION_TIMEOUT_ENV, "6000")
    try:
        ms = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{SESSION_TIMEOUT_ENV}: {raw!r} is not a whole number of ms") from None
    if not 1000 <= ms <= 300_000:
        raise ValueError(f"{SESSION_TIMEOUT_ENV}: {ms} is out of range (valid: 1000 .. 300000 ms)")
    return ms


@dataclass
class KafkaSettings:
    """Connection settings passed through to kafka-python.

    ``sasl_password`` is read from ``STEPWATCH_KAFKA_PASSWORD`` or the file named by
    ``STEPWATCH_KAFKA_PASSWORD_FILE`` (or ``password_file``).
    """

    bootstrap: str = "127.0.0.1:9092"
    prefix: str = "stepwatch."
    security_protocol: str = "PLAINTEXT"   # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    sasl_mechanism: str | None = None      # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    sasl_username: str | None = None
    password_file: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    partitions: int = 4
    client_id: str = "stepwatch"
    extra: dict = field(default_factory=dict)
    session_timeout_ms: int = field(default_factory=session_timeout_ms)   # consumers' group session

    def topic(self, name: str) -> str:
        return self.prefix + name

    def _password(self) -> str | None:
        pw = os.environ.get("STEPWATCH_KAFKA_PASSWORD")
        path = self.password_file or os.environ.get("STEPWATCH_KAFKA_PASSWORD_FILE")
        if not pw and path:
            from stepwatch import secretfile
            secretfile.check(path, "--sasl-password-file" if self.password_file else "STEPWATCH_KAFKA_PASSWORD_FILE")
            with open(path, encoding="utf-8") as f:
                pw = f.read().strip()
        return pw

    def client_config(self) -> dict:
        cfg = {"bootstrap_servers": self.bootstrap.split(","), "client_id": self.client_id,
               "security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            if not self.sasl_mechanism or not self.sasl_username:
                raise ValueError(f"security_protocol {self.security_protocol} needs --sasl-mechanism and --sasl-username")
            pw = self._password()
            if not pw:
                raise ValueError("SASL needs a password: set STEPWATCH_KAFKA_PASSWORD or STEPWATCH_KAFKA_PASSWORD_FILE")
            cfg.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                       sasl_plain_password=pw)
        for k in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(self, k):
                cfg[k] = getattr(self, k)
        cfg.update(self.extra)
        return cfg

    def __repr__(self) -> str:  # never show secrets
        return (f"KafkaSettings(bootstrap={self.bootstrap!r}, prefix={self.prefix!r}, "
                f"security_protocol={self.security_protocol!r}, sasl_mechanism={self.sasl_mechanism!r})")


def add_kafka_args(p) -> None:
    """argparse options for reaching Kafka (shared by every subcommand that talks to it)."""
    g = p.add_argument_group("kafka")
    g.add_argument("--bootstrap", default=os.environ.get("STEPWATCH_BOOTSTRAP", "127.0.0.1:9092"),
                   help="bootstrap servers host:port[,host:port] (env STEPWATCH_BOOTSTRAP)")
    g.add_argument("--topic-prefix", default=os.environ.get("STEPWATCH_TOPIC_PREFIX", "stepwatch."))
    g.add_argument("--security-protocol", default=os.environ.get("STEPWATCH_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT"),
                   choices=["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"])
    g.add_argument("--sasl-mechanism", default=os.environ.get("STEPWATCH_KAFKA_SASL_MECHANISM"),
                   choices=[None, "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
    g.add_argument("--sasl-username", default=os.environ.get("STEPWATCH_KAFKA_USERNAME"))
    g.add_argument("--sasl-password-file", default=None,
                   help="file holding the SASL password (or env STEPWATCH_KAFKA_PASSWORD[_FILE])")
    g.add_argument("--ssl-cafile")
    g.add_argument("--ssl-certfile")
    g.add_argument("--ssl-keyfile")
    g.add_argument("--partitions", type=int, default=4, help="partitions for topics this command creates")
    g.add_argument("--session-timeout-ms", type=session_timeout_ms, default=None,
                   help=f"consumer group session timeout, 1000..300000 (env {SESSION_TIMEOUT_ENV}; default 6000)")


def settings_from_args(a) -> KafkaSettings:
    return KafkaSettings(bootstrap=a.bootstrap, prefix=a.topic_prefix, security_protocol=a.security_protocol,
                         sasl_mechanism=a.sasl_mechanism, sasl_username=a.sasl_username,
                         password_file=a.sasl_password_file, ssl_cafile=a.ssl_cafile,
                         ssl_certfile=a.ssl_certfile, ssl_keyfile=a.ssl_keyfile, partitions=a.partitions,
                         session_timeout_ms=session_timeout_ms(getattr(a, "session_timeout_ms", None)))


def ensure_topics(s: KafkaSettings, names=TOPIC_NAMES, partitions: int | None = None) -> list[str]:
    """Create the topics that do not exist yet; returns the ones created."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError
    admin = KafkaAdminClient(**s.client_config())
    try:
        have = set(admin.list_topics())
        want = [s.topic(n) for n in names if s.topic(n) not in have]
        if want:
            try:
                admin.create_topics([NewTopic(t, partitions or s.partitions, 1) for t in want])
            except TopicAlreadyExistsError:
                pass
        return want
    finally:
        admin.close()


def cluster_id_of(bootstrap: str, timeout_s: float = 2.0, config: dict | None = None) -> str | None:
    """Ask the broker for its cluster id (MetadataRequest v2+); None if it does not answer.
    ``config``: extra kafka-python client settings (SASL/SSL)."""
    from kafka.admin import KafkaAdminClient
    from kafka.errors import KafkaError
    try:
        cfg = dict(config or {}, bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000),
                   client_id="stepwatch-probe")
        admin = KafkaAdminClient(**cfg)
    except (KafkaError, OSError):  # not up yet
        return None
    try:
        return admin.describe_cluster().get("cluster_id")
    except (KafkaError, OSError):
        return None
    finally:
        admin.close()


def make_producer(s: KafkaSettings, **kw):
    from kafka import KafkaProducer
    # retries: the client's default (retry until delivery_timeout_ms, 120 s; Kafka's own rule since
    # KIP-91) -- a fixed count of 5 gave up within a second on a broker busy for longer, and the batch was lost
    cfg = dict(s.client_config(), acks="all", linger_ms=5, max_request_size=64 << 20,
               batch_size=1 << 20)
    cfg.update(kw)
    return KafkaProducer(**cfg)


def make_consumer(s: KafkaSettings, group: str, **kw):
    from kafka import KafkaConsumer
    cfg = dict(s.client_config(), group_id=group, enable_auto_commit=False, auto_offset_reset="earliest",
               session_timeout_ms=s.session_timeout_ms,
               heartbeat_interval_ms=max(100, min(1000, s.session_timeout_ms // 4)), max_poll_interval_ms=300_000,
               max_partition_fetch_bytes=64 << 20, fetch_max_bytes=256 << 20, max_poll_records=2000,
               fetch_max_wait_ms=100)
    cfg.update(kw)
    return KafkaConsumer(**cfg)


def send_table(producer, s: KafkaSettings, kind: str, table: "pa.Table", max_rows: int = 4096,
               content_type: str = ARROW_CT):
    """Send a table as Arrow IPC messages of at most ``max_rows`` rows, keyed by job.

    Rows must belong to one job per call (the key). Returns the list of send futures.
    """
    from stepwatch.wire.encode import encode_arrow, encode_json   # the encoder alone (pyarrow, no decoder)
    if table.num_rows == 0:
        return []
    job = table.column("job")[0].as_py()
    key = job.encode()
    topic = s.topic(kind)
    hdr = headers(kind, content_type)
    futs = []
    for off in range(0, table.num_rows, max_rows):
        part = table.slice(off, max_rows)
        payload = encode_arrow(part) if content_type == ARROW_CT else encode_json(part.to_pylist())
        futs.append(producer.send(topic, payload, key=key, headers=hdr))
    return futs
