"""The verdict cache: an LLM coach's verdicts (and hindsight Reviews) by a hash of the coach's name and the
prompt it is sent, in memory and in SQLite, so reruns, resumed runs and re-scoring never pay twice. The key is
everything the coach sees and nothing else (no random episode id). Only "ok" verdicts are stored: a timeout or
a parse error must be retried, not replayed. A hit comes back `cached=True` (accounting counts fresh calls).

New verdicts reach the disk from one writer thread, one transaction per FLUSH_S seconds and at close, so the
event loop never waits on a commit (slow on a network filesystem); a run killed hard loses at most FLUSH_S
seconds of verdicts, which a resumed run asks for again.
"""

import asyncio
import hashlib
import json
import logging
import os
import sqlite3
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from openrlhf_mappa.episode import Verdict

logger = logging.getLogger(__name__)

FLUSH_S = 0.5
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def check_cache_file(path: str) -> None:
    """Refuse a path that is not an SQLite database (a directory, a JSON file) without writing anything: the
    launcher checks it before it writes into the run directory. An empty file is a new database to SQLite."""
    if os.path.isdir(path):
        raise ValueError(
            f"coach cache {path}: is a directory; the verdict cache is one SQLite file (or 'none')"
        )
    if os.path.exists(path):
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
        if head and head != SQLITE_HEADER:
            raise ValueError(
                f"coach cache {path}: not an SQLite database (the coach's verdict cache); give another "
                f"path, or 'none' for a cache in memory only"
            )


class VerdictCache:
    def __init__(self, path: Optional[str] = None):
        self.path, self.memory = path, {}
        self.pending = []  # (key, verdict JSON) not yet handed to the writer
        self.db, self.writer, self.read_disk = None, None, False
        if path:
            check_cache_file(path)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            try:
                # the writer thread's commits never block these reads
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute(
                    "CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, verdict TEXT NOT NULL)"
                )
            except sqlite3.DatabaseError as e:  # an SQLite header on a damaged file
                self.db.close()
                raise ValueError(f"coach cache {path}: {e}; give another path, or 'none'") from None
            # Only verdicts the file held when opened can be missing from memory: a fresh cache never reads
            # disk.
            self.read_disk = self.db.execute("SELECT EXISTS (SELECT 1 FROM verdicts)").fetchone()[0] == 1
            self.writer = ThreadPoolExecutor(1, thread_name_prefix="verdict-cache")
            self.write_db = self.writer.submit(sqlite3.connect, path, isolation_level=None).result()

    @staticmethod
    def key(coach_name: str, prompt: str) -> str:
        return hashlib.sha256(f"{coach_name}\0{prompt}".encode("utf-8", errors="surrogatepass")).hexdigest()

    def get(self, key: str, kind: type = Verdict):
        """The stored Verdict, or hindsight Review with kind=Review (its key names it: see
        OpenAICoach.review)."""
        if key not in self.memory and self.read_disk:
            row = self.db.execute("SELECT verdict FROM verdicts WHERE key = ?", (key,)).fetchone()
            if row:
                self.memory[key] = kind(**json.loads(row[0]))
        return self.memory.get(key)

    def put(self, key: str, verdict):
        self.memory[key] = verdict
        if self.writer is not None:
            # Serialized here: Python code on the writer thread would hold the GIL, stalling the event loop;
            # the writer only runs SQLite, which releases it.
            self.pending.append((key, json.dumps(vars(verdict), ensure_ascii=False)))
            if len(self.pending) == 1:
                try:
                    asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
                except RuntimeError:  # no event loop (a synchronous caller): hand it over now
                    self.flush()

    def flush(self) -> Optional[Future]:
        """Hand the pending verdicts to the writer thread; the future is done once they are on disk."""
        if self.writer is None:  # closed before a scheduled flush came due: close() wrote everything
            return None
        rows, self.pending = self.pending, []
        return self.writer.submit(self.write, rows)

    def write(self, rows: list):  # on the writer thread
        if not rows:
            return
        try:
            self.write_db.execute("BEGIN")
            self.write_db.executemany("INSERT OR REPLACE INTO verdicts (key, verdict) VALUES (?, ?)", rows)
            self.write_db.execute("COMMIT")
        except sqlite3.Error as e:
            # a full or vanished disk: these verdicts would be paid again after a restart
            logger.error("verdict cache %s: could not write %d verdicts: %s", self.path, len(rows), e)
            if self.write_db.in_transaction:
                self.write_db.rollback()

    def __len__(self):
        if self.db is None:
            return len(self.memory)
        self.flush().result()
        return self.db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]

    def close(self):
        if self.writer is not None:
            self.flush().result()
            self.writer.submit(self.write_db.close).result()
            self.writer.shutdown()
            self.db.close()
            self.db = self.writer = None
