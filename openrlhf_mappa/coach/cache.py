"""The verdict cache: an LLM coach's verdicts by a hash of (coach model, prompt template, request content), in
memory and in SQLite, so that reruns, resumed runs and re-scoring never pay twice for the same judgement.

Only "ok" verdicts are stored: a timeout or a parse error may not happen again, and it must be retried,
not replayed. The episode id is not part of the key (it is random per run); everything the coach sees is.
"""

import dataclasses
import hashlib
import json
import os
import sqlite3
from typing import Optional

from openrlhf_mappa.coach import Coach, CoachRequest
from openrlhf_mappa.episode import Verdict


class VerdictCache:
    def __init__(self, path: Optional[str] = None):
        self.memory = {}
        self.db = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            # Autocommit + WAL: every verdict is on disk when put() returns, so a run killed at any moment
            # keeps all it has paid for, at the cost of one small write per verdict.
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, verdict TEXT NOT NULL)")

    @staticmethod
    def key(coach_name: str, template: str, request: CoachRequest) -> str:
        content = dataclasses.asdict(request)
        content.pop("episode_id")
        blob = json.dumps([coach_name, template, content], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def get(self, key: str) -> Optional[Verdict]:
        if key not in self.memory and self.db is not None:
            row = self.db.execute("SELECT verdict FROM verdicts WHERE key = ?", (key,)).fetchone()
            if row:
                self.memory[key] = Verdict(**json.loads(row[0]))
        return self.memory.get(key)

    def put(self, key: str, verdict: Verdict):
        self.memory[key] = verdict
        if self.db is not None:
            blob = json.dumps(dataclasses.asdict(verdict), ensure_ascii=False)
            self.db.execute("INSERT OR REPLACE INTO verdicts (key, verdict) VALUES (?, ?)", (key, blob))

    def __len__(self):
        if self.db is not None:
            return self.db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]
        return len(self.memory)

    def close(self):
        if self.db is not None:
            self.db.close()
            self.db = None


class CachedCoach(Coach):
    """Any coach with a `template`, behind a VerdictCache. A hit comes back with `cached=True`; its tokens
    and latency are those of the original call (accounting counts only fresh verdicts as spent)."""

    def __init__(self, inner: Coach, cache: VerdictCache):
        self.inner, self.cache = inner, cache
        self.name, self.template = inner.name, inner.template

    async def score(self, request: CoachRequest) -> Verdict:
        key = self.cache.key(self.name, self.template, request)
        hit = self.cache.get(key)
        if hit is not None:
            return dataclasses.replace(hit, cached=True)
        verdict = await self.inner.score(request)
        if verdict.status == "ok":
            self.cache.put(key, verdict)
        return verdict

    async def aclose(self):
        await self.inner.aclose()
        self.cache.close()
