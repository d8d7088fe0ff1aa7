"""The verdict cache: an LLM coach's verdicts by a hash of (coach model, prompt template, request content), in
memory and in SQLite, so that reruns, resumed runs and re-scoring never pay twice for the same judgement.
A hit comes back with `cached=True` and the tokens and latency of the original call (accounting counts only
fresh verdicts as spent). Hindsight reviews (episode.Review) are stored the same way, under keys of their own.

The key hashes the coach's name and the prompt it is sent (the template filled with the request): everything
the coach sees and nothing else, so the random episode id and fields the template leaves out never cause a
miss. Only "ok" verdicts are stored: a timeout or a parse error may not happen again, and it must be
retried, not replayed.

New verdicts reach the disk from one writer thread, in one transaction per FLUSH_S seconds and at close: the
event loop that drives rollouts and coach calls never waits on a commit (on a cluster's network filesystem
a commit can take tens of milliseconds). A run killed hard loses at most its last FLUSH_S seconds of
verdicts, which a resumed run asks for again.
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
    """Refuse a cache path that is not an SQLite database (a directory, a JSON file given by mistake) without
    writing anything: the launcher checks it before it writes into the run directory. An empty file is a new
    database to SQLite."""
    if os.path.isdir(path):
        raise ValueError(f"coach cache {path}: is a directory; the verdict cache is one SQLite file (or 'none')")
    if os.path.exists(path):
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
        if head and head != SQLITE_HEADER:
            raise ValueError(f"coach cache {path}: not an SQLite database (the coach's verdict cache); give another "
                             f"path, or 'none' for a cache in memory only")


class VerdictCache:
    def __init__(self, path: Optional[str] = None):
        self.path, self.memory = path, {}
        self.pending = []  # (key, verdict JSON) not yet handed to the writer
        self.db = self.writer = None
        self.read_disk = False
        if path:
            check_cache_file(path)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            try:
                self.db.execute("PRAGMA journal_mode=WAL")  # the writer thread's commits never block these reads
                self.db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, verdict TEXT NOT NULL)")
            except sqlite3.DatabaseError as e:  # an SQLite header on a damaged file
                self.db.close()
                raise ValueError(f"coach cache {path}: {e}; give another path, or 'none'") from None
            # Only verdicts the file held when opened can be missing from memory (all later ones pass through
            # it), so a fresh cache never pays for a disk lookup on a miss.
            self.read_disk = self.db.execute("SELECT EXISTS (SELECT 1 FROM verdicts)").fetchone()[0] == 1
            self.writer = ThreadPoolExecutor(1, thread_name_prefix="verdict-cache")
            self.write_db = self.writer.submit(sqlite3.connect, path, isolation_level=None).result()

    @staticmethod
    def key(coach_name: str, prompt: str) -> str:
        return hashlib.sha256(f"{coach_name}\0{prompt}".encode("utf-8", errors="surrogatepass")).hexdigest()

    def get(self, key: str, kind: type = Verdict):
        """The stored Verdict, or hindsight Review with kind=Review (its key names it: see OpenAICoach.review)."""
        if key not in self.memory and self.read_disk:
            row = self.db.execute("SELECT verdict FROM verdicts WHERE key = ?", (key,)).fetchone()
            if row:
                self.memory[key] = kind(**json.loads(row[0]))
        return self.memory.get(key)

    def put(self, key: str, verdict):
        self.memory[key] = verdict
        if self.writer is not None:
            # Serialized here, not on the writer thread: Python code there would hold the GIL for milliseconds
            # at a time, stalling the event loop; the writer only runs SQLite, which releases the GIL.
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
        except sqlite3.Error as e:  # a full or vanished disk: these verdicts would be paid again after a restart
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
