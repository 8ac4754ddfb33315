"""A ``KafkaConnection`` as client configuration, secrets resolved; Kafka error classes.

``kafka_python_options`` gives the keyword arguments of kafka-python's clients,
``librdkafka_config`` the properties of librdkafka's (confluent-kafka). Both take
their names from ``conveyor.core.connection.OPTION_NAMES``. Secret references are
resolved here, inside the run, and the resolved values never leave the returned
dict: do not log it.

``classify_kafka_error`` is the one place that says what an exception from
kafka-python or confluent-kafka (librdkafka's error names are mapped onto
kafka-python's classes) means: a record's content (``data``), something no retry fixes
(``permanent``: authentication, authorization, TLS certificate, an unsupported
codec or feature, bad configuration, any error the client marks non-retriable),
or an outage (``transient``). ``close_producer`` closes either client's producer without
leaving kafka-python's network thread behind.
"""

from __future__ import annotations

import difflib
import logging
import ssl
from collections.abc import Callable
from typing import Any, Literal

from conveyor.core.connection import OPTION_NAMES, KafkaConnection, check_readable
from conveyor.core.errors import ConfigError
from conveyor.core.sink import ErrorKind
from conveyor.core.trust.secrets import resolve

log = logging.getLogger("conveyor.kafka")

ClientRole = Literal["consumer", "producer", "admin"]

# kafka-python settings a connection's client_options may not override: Conveyor owns
# them (placement, offsets, delivery guarantees) or they are the model's own fields.
OWNED_OPTIONS = frozenset(
    {
        "group_id",
        "enable_auto_commit",
        "auto_offset_reset",
        "isolation_level",
        "key_deserializer",
        "value_deserializer",
        "key_serializer",
        "value_serializer",
        "ssl_context",
        "sasl_oauth_token_provider",
        "enable_idempotence",
        "acks",
        "transactional_id",
        *(kp for kp, _ in OPTION_NAMES.values()),
    }
)


def resolve_secret(ref: str, *, field: str) -> str:
    """The value behind a connection secret's reference (``conveyor.core.trust.secrets.resolve``), read
    at each connection; ConfigError naming ``field`` when it cannot be read."""
    value: str = resolve(ref, field=field)
    return value


def check_files(c: KafkaConnection, *, prefix: str) -> dict[str, str]:
    """The real path of every certificate / key file of the connection, resolved under a root
    now and readable (``core.connection.check_readable``; ConfigError naming the field): the
    client is given these paths."""
    return check_readable(c, ("ssl_cafile", "ssl_certfile", "ssl_keyfile"), prefix=prefix)


def _kafka_python_known(role: ClientRole) -> set[str]:
    from kafka import KafkaConsumer, KafkaProducer
    from kafka.admin import KafkaAdminClient

    cls = {"consumer": KafkaConsumer, "producer": KafkaProducer, "admin": KafkaAdminClient}[role]
    return set(cls.DEFAULT_CONFIG)


def check_client_options(c: KafkaConnection, role: ClientRole, *, prefix: str) -> None:
    """client_options are kafka-python settings of this client and not owned by Conveyor."""
    known = _kafka_python_known(role)
    for name in c.client_options:
        if name in OWNED_OPTIONS:
            raise ConfigError(
                f"{name!r} is set by Conveyor (or is one of the connection's own fields)",
                field=f"{prefix}.client_options",
            )
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{name!r} is not a kafka-python {role} setting{hint}",
                field=f"{prefix}.client_options",
            )


class FileTokenProvider:
    """OAUTHBEARER token from a secret reference, read again at every (re)connection."""

    def __init__(self, ref: str, field: str):
        self.ref = ref
        self.field = field

    def token(self) -> str:
        return resolve_secret(self.ref, field=self.field)

    def extensions(self) -> dict[str, str]:
        return {}


def _token_provider(ref: str, field: str) -> Any:
    from kafka.net.sasl.oauth import AbstractTokenProvider

    class _Provider(FileTokenProvider, AbstractTokenProvider):
        pass

    return _Provider(ref, field)


def kafka_python_options(
    c: KafkaConnection,
    role: ClientRole,
    *,
    prefix: str,
    default_bootstrap: Callable[[], str] | None = None,
    client_id: str | None = None,
) -> dict[str, Any]:
    """kafka-python keyword arguments of the connection (secrets resolved: never log them).

    Raises ConfigError naming the field for a missing secret, an unreadable file, a
    GSSAPI connection without the ``gssapi`` package or a bad client option.
    """
    bootstrap = c.bootstrap_servers or (default_bootstrap() if default_bootstrap else None)
    if not bootstrap:
        raise ConfigError("required", field=f"{prefix}.bootstrap_servers")
    files = check_files(c, prefix=prefix)
    check_client_options(c, role, prefix=prefix)
    kw: dict[str, Any] = {
        "bootstrap_servers": [s.strip() for s in bootstrap.split(",") if s.strip()],
        "security_protocol": c.security_protocol,
    }
    cid = c.client_id or client_id
    if cid:
        kw["client_id"] = cid
    if c.security_protocol.startswith("SASL"):
        kw["sasl_mechanism"] = c.sasl_mechanism
        if c.sasl_mechanism == "OAUTHBEARER":
            assert c.sasl_oauthbearer_token is not None
            field = f"{prefix}.sasl_oauthbearer_token"
            resolve_secret(c.sasl_oauthbearer_token, field=field)  # fail now, not at connect
            kw["sasl_oauth_token_provider"] = _token_provider(c.sasl_oauthbearer_token, field)
        elif c.sasl_mechanism == "GSSAPI":
            try:
                import gssapi  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "GSSAPI needs the Python package 'gssapi' (pip install gssapi), which is not installed",
                    field=f"{prefix}.sasl_mechanism",
                ) from None
            kw["sasl_kerberos_service_name"] = c.sasl_kerberos_service_name
        else:
            kw["sasl_plain_username"] = c.sasl_username
            assert c.sasl_password is not None
            kw["sasl_plain_password"] = resolve_secret(
                c.sasl_password, field=f"{prefix}.sasl_password"
            )
    if c.security_protocol.endswith("SSL"):
        kw["ssl_check_hostname"] = c.ssl_check_hostname
        for name, real in files.items():
            kw[OPTION_NAMES[name][0]] = real
        if c.ssl_key_password:
            kw["ssl_password"] = resolve_secret(
                c.ssl_key_password, field=f"{prefix}.ssl_key_password"
            )
    kw.update(c.client_options)
    return kw


# librdkafka properties a librdkafka client's client_options may not override (as
# OWNED_OPTIONS for kafka-python).
OWNED_LIBRDKAFKA = frozenset(
    {
        "group.id",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "auto.offset.reset",
        "isolation.level",
        "enable.partition.eof",
        "error_cb",
        "on_commit",
        "enable.idempotence",
        "acks",
        "transactional.id",
        "ssl.key.pem",
        "ssl.certificate.pem",
        "ssl.ca.pem",
        *(rd for _, rd in OPTION_NAMES.values()),
    }
)


def check_librdkafka_options(c: KafkaConnection, *, prefix: str) -> None:
    """client_options of a librdkafka client: not owned by Conveyor (unknown names are
    refused by librdkafka itself when the client is created)."""
    for name in c.client_options:
        if name in OWNED_LIBRDKAFKA:
            raise ConfigError(
                f"{name!r} is set by Conveyor (or is one of the connection's own fields)",
                field=f"{prefix}.client_options",
            )
        if "_" in name and "." not in name:
            raise ConfigError(
                f"{name!r} is not a librdkafka property (the confluent client takes librdkafka's "
                f"dotted names, e.g. {name.replace('_', '.')!r})",
                field=f"{prefix}.client_options",
            )


def librdkafka_config(
    c: KafkaConnection,
    *,
    prefix: str,
    default_bootstrap: Callable[[], str] | None = None,
    client_id: str | None = None,
    client_options: bool = False,
) -> dict[str, Any]:
    """librdkafka (confluent-kafka) properties of the connection (secrets resolved: never log them).

    ``client_options`` are included only for a client that takes them under librdkafka's
    names (``client_options=True``: the confluent source); elsewhere they are named for
    kafka-python.
    """
    bootstrap = c.bootstrap_servers or (default_bootstrap() if default_bootstrap else None)
    if not bootstrap:
        raise ConfigError("required", field=f"{prefix}.bootstrap_servers")
    files = check_files(c, prefix=prefix)
    name = {k: rd for k, (_, rd) in OPTION_NAMES.items()}
    conf: dict[str, Any] = {
        name["bootstrap_servers"]: bootstrap,
        name["security_protocol"]: c.security_protocol,
    }
    cid = c.client_id or client_id
    if cid:
        conf[name["client_id"]] = cid
    if c.security_protocol.startswith("SASL"):
        conf[name["sasl_mechanism"]] = c.sasl_mechanism
        if c.sasl_mechanism == "OAUTHBEARER":
            assert c.sasl_oauthbearer_token is not None
            provider = FileTokenProvider(
                c.sasl_oauthbearer_token, f"{prefix}.sasl_oauthbearer_token"
            )
            provider.token()
            # confluent-kafka's oauth_cb returns (token, expiry as epoch seconds); the token
            # is asked for again before that expiry.
            conf[name["sasl_oauthbearer_token"]] = lambda _cfg: (
                provider.token(),
                __import__("time").time() + 300,
            )
        elif c.sasl_mechanism == "GSSAPI":
            conf[name["sasl_kerberos_service_name"]] = c.sasl_kerberos_service_name
        else:
            assert c.sasl_password is not None
            conf[name["sasl_username"]] = c.sasl_username
            conf[name["sasl_password"]] = resolve_secret(
                c.sasl_password, field=f"{prefix}.sasl_password"
            )
    if c.security_protocol.endswith("SSL"):
        conf[name["ssl_check_hostname"]] = "https" if c.ssl_check_hostname else "none"
        for field, real in files.items():
            conf[name[field]] = real
        if c.ssl_key_password:
            conf[name["ssl_key_password"]] = resolve_secret(
                c.ssl_key_password, field=f"{prefix}.ssl_key_password"
            )
    if client_options:
        check_librdkafka_options(c, prefix=prefix)
        conf.update(c.client_options)
    return conf


def tls_handshake_options(
    c: KafkaConnection,
    role: ClientRole,
    *,
    prefix: str,
    default_bootstrap: Callable[[], str] | None = None,
) -> dict[str, Any]:
    """The connection of a librdkafka client as kafka-python options, for ``tls_problem``'s
    handshake (the one check of certificates before librdkafka retries them silently).
    Empty without TLS; client_options (librdkafka's names there) and SASL are left out:
    they play no part in the handshake."""
    if not c.security_protocol.endswith("SSL"):
        return {}
    plain = c.model_copy(update={"client_options": {}, "sasl_mechanism": None})
    if plain.security_protocol == "SASL_SSL":
        plain = plain.model_copy(update={"security_protocol": "SSL"})
    return kafka_python_options(plain, role, prefix=prefix, default_bootstrap=default_bootstrap)


def tls_problem(options: dict[str, Any], timeout_s: float = 10.0) -> str | None:
    """Why a TLS connection with these kafka-python options cannot work, or None.

    kafka-python retries a bootstrap whose TLS handshake fails until its timeout and then
    reports only "Unable to bootstrap". This handshake, with the context kafka-python
    builds from the same options, names the problem at once: a certificate the CA does
    not sign, a host name the certificate does not hold, key files that do not load. A
    server that cannot be reached is not a TLS problem (the client reports the outage).
    """
    if not str(options.get("security_protocol", "")).endswith("SSL"):
        return None
    import socket

    from kafka.net.transport import KafkaSSLTransport

    settings = dict(KafkaSSLTransport.DEFAULT_CONFIG)
    settings.update({k: v for k, v in options.items() if k in settings})
    try:
        ctx = KafkaSSLTransport._build_ssl_context(settings)
    except (ssl.SSLError, OSError, ValueError) as e:
        return f"the TLS files cannot be loaded: {e}"
    for hp in options.get("bootstrap_servers") or ():
        host, _, port = str(hp).rpartition(":")
        host = host.strip("[]")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except (OSError, ValueError):
            continue
        try:
            with ctx.wrap_socket(sock, server_hostname=host):
                return None
        except ssl.SSLCertVerificationError as e:
            return f"TLS certificate of {hp} rejected: {e.verify_message or e.reason or e}"
        except (ssl.SSLError, OSError) as e:
            return f"TLS handshake with {hp} failed: {e}"
        finally:
            sock.close()
    return None


# -- error classes ------------------------------------------------------------------------

# A record the cluster (or the client, before sending) refuses for its content.
_DATA_ERRORS = frozenset(
    {
        "MessageSizeTooLargeError",
        "RecordListTooLargeError",
        "InvalidTopicError",
        "CorruptRecordError",
        "InvalidRecordError",
        "InvalidTimestampError",
        "UnsupportedForMessageFormatError",
    }
)
# Refusals no retry can fix.
_PERMANENT_ERRORS = frozenset(
    {
        "AuthorizationError",  # topic / group / cluster / transactional-id authorization
        "SaslAuthenticationFailedError",
        "UnsupportedSaslMechanismError",
        "IllegalSaslStateError",
        "SecurityDisabledError",
        "UnsupportedVersionError",
        "UnsupportedCompressionTypeError",
        "UnsupportedCodecError",  # the client lacks a codec's library
        "KafkaConfigurationError",
        "PolicyViolationError",
        "InvalidRequiredAcksError",
        "InvalidSessionTimeoutError",
    }
)
# Non-retriable by the client's flag, but an outage or a state the client recovers from.
_NOT_PERMANENT = frozenset(
    {
        "KafkaError",  # the base class: no information
        "UnknownError",
        "UnknownServerError",
        "OffsetOutOfRangeError",  # reset by auto_offset_reset
        "CommitFailedError",
        "IllegalStateError",
        "UnknownBrokerIdError",
        "UnrecognizedBrokerVersion",
        "InvalidReceiveError",
        "KafkaProtocolError",
        "NoBrokersAvailable",
        "OutOfOrderSequenceNumberError",
        "InvalidProducerEpochError",
        "ProducerFencedError",
        "DuplicateSequenceNumberError",
        "QuotaViolationError",
    }
)

_CERT_WORDS = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed", "Hostname mismatch")

# librdkafka's error names (confluent-kafka's KafkaError.name()) as the kafka-python
# error class of the same meaning: both clients go through the sets above.
_LIBRDKAFKA_NAMES = {
    "TOPIC_AUTHORIZATION_FAILED": "AuthorizationError",
    "GROUP_AUTHORIZATION_FAILED": "AuthorizationError",
    "CLUSTER_AUTHORIZATION_FAILED": "AuthorizationError",
    "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": "AuthorizationError",
    "SASL_AUTHENTICATION_FAILED": "SaslAuthenticationFailedError",
    "_AUTHENTICATION": "SaslAuthenticationFailedError",
    "UNSUPPORTED_SASL_MECHANISM": "UnsupportedSaslMechanismError",
    "ILLEGAL_SASL_STATE": "IllegalSaslStateError",
    "SECURITY_DISABLED": "SecurityDisabledError",
    "UNSUPPORTED_VERSION": "UnsupportedVersionError",
    "UNSUPPORTED_COMPRESSION_TYPE": "UnsupportedCompressionTypeError",
    "_NOT_IMPLEMENTED": "UnsupportedCodecError",
    "_UNSUPPORTED_FEATURE": "UnsupportedVersionError",
    "_INVALID_ARG": "KafkaConfigurationError",
    "POLICY_VIOLATION": "PolicyViolationError",
    "INVALID_REQUIRED_ACKS": "InvalidRequiredAcksError",
    "INVALID_SESSION_TIMEOUT": "InvalidSessionTimeoutError",
    "MSG_SIZE_TOO_LARGE": "MessageSizeTooLargeError",
    "_MSG_SIZE_TOO_LARGE": "MessageSizeTooLargeError",
    "RECORD_LIST_TOO_LARGE": "RecordListTooLargeError",
    "TOPIC_EXCEPTION": "InvalidTopicError",
    "INVALID_TOPIC_EXCEPTION": "InvalidTopicError",
    "INVALID_MSG": "CorruptRecordError",  # CORRUPT_MESSAGE in Kafka's protocol
    "_BAD_MSG": "CorruptRecordError",
    "INVALID_RECORD": "InvalidRecordError",
    "INVALID_TIMESTAMP": "InvalidTimestampError",
    "UNSUPPORTED_FOR_MESSAGE_FORMAT": "UnsupportedForMessageFormatError",
}


def _librdkafka_error(exc: BaseException) -> Any:
    """The confluent-kafka KafkaError an exception carries, or None."""
    if type(exc).__name__ == "KafkaException" and exc.args:
        err = exc.args[0]
        return err if hasattr(err, "fatal") and hasattr(err, "name") else None
    return exc if type(exc).__name__ == "KafkaError" and hasattr(exc, "fatal") else None


def close_producer(producer: Any, timeout: float, *, quiet: bool = False) -> None:
    """Close a producer, delivering what it buffers within ``timeout`` s and abandoning the
    rest (the batch is sent again); ``quiet``: without kafka-python's closing log lines.

    kafka-python's ``close`` flushes before it stops its network thread, even with timeout
    0, and raises when records are still in flight: the thread then kept running, with its
    connections, after the producer was dropped (one per outage, for the process's life).
    When ``close`` raises, the thread is stopped without sending (``Sender.force_close``:
    the records left fail) and the producer closed again. Best effort: a producer that
    cannot be closed is logged.
    """
    try:
        producer.close(timeout=timeout, null_logger=quiet)
        return
    except Exception:  # noqa: BLE001 - records in flight; stopped below
        log.debug("closing the producer within %s s failed", timeout, exc_info=True)
    network = getattr(producer, "_sender", None)  # kafka-python's I/O thread
    if network is None:
        return
    try:
        network.force_close()
        network.join(5)
        producer.close(timeout=0, null_logger=quiet)
    except Exception:  # noqa: BLE001 - closing is best effort
        log.debug("error closing producer", exc_info=True)
    if network.is_alive():
        log.warning("a Kafka producer's network thread did not stop within 5 s")


def classify_kafka_error(exc: BaseException) -> ErrorKind:
    """What an exception from kafka-python or confluent-kafka means.

    data: a record's content (too large, corrupt, bad topic); a sink isolates the row,
    a source cannot skip it (the caller makes it permanent). permanent: auth,
    authorization, a TLS certificate the client rejects, an unsupported codec, feature
    or setting, or any error the client flags non-retriable that is not known to be an
    outage (librdkafka: any error it marks fatal). transient: everything else
    (timeouts, connection errors, no leader).
    """
    rd = _librdkafka_error(exc)
    if rd is not None:
        names = {_LIBRDKAFKA_NAMES.get(rd.name(), rd.name())}
        if names & _DATA_ERRORS:
            return ErrorKind.DATA
        # librdkafka marks an error fatal when the client cannot go on (no retry helps).
        if names & _PERMANENT_ERRORS or rd.fatal():
            return ErrorKind.PERMANENT
        if any(w in (rd.str() or "") for w in _CERT_WORDS):
            return ErrorKind.PERMANENT
        return ErrorKind.TRANSIENT
    names = {k.__name__ for k in type(exc).__mro__}
    if names & _DATA_ERRORS:
        return ErrorKind.DATA
    if names & _PERMANENT_ERRORS:
        return ErrorKind.PERMANENT
    if isinstance(exc, ssl.SSLCertVerificationError) or any(w in str(exc) for w in _CERT_WORDS):
        return ErrorKind.PERMANENT  # a wrong CA or host name does not fix itself
    if "KafkaError" in names:
        flagged = getattr(exc, "retriable", True) is False
        return (
            ErrorKind.PERMANENT
            if flagged and type(exc).__name__ not in _NOT_PERMANENT
            else ErrorKind.TRANSIENT
        )
    if isinstance(exc, (ValueError, TypeError)):
        return ErrorKind.DATA  # client-side checks: illegal topic, unknown partition, header types
    return ErrorKind.TRANSIENT


def describe_kafka_error(exc: BaseException) -> str:
    """One line: the class name and the message (for TLS errors, the certificate problem)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate rejected: {exc.verify_message or exc.reason or exc}"
    rd = _librdkafka_error(exc)
    if rd is not None:
        return f"{rd.name()}: {' '.join((rd.str() or '').split())}"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if type(exc).__name__ in text else f"{type(exc).__name__}: {text}"
