"""The transformer's Spark session: made on first use (so evaluating a sensor never starts
one), shared by the threads transforming batches, replaced after a server restart."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from conveyor.spark.session import (
    discard_session,
    is_session_lost,
    no_sql_on_files,
    one_stream_per_query,
)


class LazySession:
    """A session, or a factory of sessions (a new one after the server lost the last)."""

    def __init__(self, session: Any | Callable[[], Any]):
        self._session_or_factory = session
        self._session: Any = None
        self._session_lock = threading.Lock()  # batches may be transformed on several threads

    @property
    def session(self) -> Any:
        with self._session_lock:
            if self._session is None:
                s = self._session_or_factory
                self._session = s() if callable(s) and not hasattr(s, "createDataFrame") else s
                one_stream_per_query(self._session)
                no_sql_on_files(self._session)
            return self._session

    def lost(self, e: BaseException) -> None:
        """After a server restart, the next attempt runs on a new session."""
        with self._session_lock:
            lost = self._session
            if is_session_lost(e) and lost is not None and callable(self._session_or_factory):
                discard_session(lost)
                self._session = None
