"""A coach behind any OpenAI-compatible chat-completions server (OpenAI, vLLM, SGLang, Ollama, LiteLLM,
Gemini).

One verdict: ask at temperature 0 with a JSON schema {rationale, score} as `response_format` ("auto": dropped
for the rest of the run after a 400 that names it); retry transient failures (429 with Retry-After, 408/409,
5xx, timeouts, dropped connections, non-JSON bodies) up to `max_retries` times with jittered backoff, other
errors being final; re-prompt a reply without a valid score at most `format_retries` times. What still fails
is a Verdict with status api_error / timeout / parse_error and NO score. A hindsight `review` goes the same
way with its own schema and parser, and fails as a whole. The wire protocol is spoken with aiohttp directly:
the `openai` SDK's per-call CPU cost limited the coach's throughput (benchmarks/coach_throughput.py).
"""

import asyncio
import dataclasses
import email.utils
import json
import logging
import os
import random
import re
import time

import aiohttp
import yarl

from openrlhf_mappa.coach.base import (DEFAULT_REVIEW_TEMPLATE, Coach, CoachRequest, parse_answer_correct,
                                       parse_review, parse_score, render_prompt, render_review_prompt)
from openrlhf_mappa.coach.cache import VerdictCache
from openrlhf_mappa.episode import Review, Verdict
from openrlhf_mappa.topology import DEFAULT_SCORE_KEY, SCORE_KEY_RE

logger = logging.getLogger(__name__)


def _object(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _response_format(name: str, properties: dict) -> dict:
    """A strict JSON-schema `response_format`: an object with exactly these properties, all required."""
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "strict": True, "schema": _object(properties)},
    }


# The rationale comes first so that the coach reasons before it commits to a number.
VERDICT_SCHEMA = _response_format(
    "coach_verdict", {"rationale": {"type": "string"}, "score": {"type": "number"}}
)
REVIEW_SCHEMA = _response_format("coach_review", {
    "rationale": {"type": "string"}, "responsible": {"type": "integer"},
    "actions": {"type": "array", "items": _object({"id": {"type": "integer"}, "score": {"type": "number"}})},
})
SCHEMA_WORDS = re.compile(r"response_format|schema|structured|guided|grammar", re.IGNORECASE)
# A re-prompt is the original prompt plus this reminder, not a conversation with the unscorable reply in
# it: a reply that ran to the token limit, sent back, would push a small coach past its context length.
REPROMPT = (
    "\n\n(Reminder: an earlier reply to this request stated no valid score. End your reply with a line "
    "`{key}: <number from 0 to 10>`.)"
)
REVIEW_REPROMPT = (
    "\n\n(Reminder: an earlier reply to this request was not a valid review. Reply with one JSON object "
    'only, with "rationale", "responsible" (an action id) and "actions": exactly one entry {{"id": <id>, '
    '"score": <number from 0 to 10>}} for each action id from 1 to {n}.)'
)
# The authors' re-prompt for a Verifier's verdict that lacks ANSWER_CORRECT (their external_coach.py L335-365
# with L415-450), word for word: their earlier reply alone, without the task, and the two lines it must state.
ANSWER_REPROMPT = """You previously provided this evaluation:

{reply}

However, the response format was incorrect. Error: OUTCOME_SCORE/ANSWER_CORRECT missing for Verifier with \
ground truth

Please provide your evaluation again using EXACTLY this format:

{key}: [0.0 to 10.0]
ANSWER_CORRECT: [0 or 1]

Do not include any other text or explanation. Only output the score(s) in the exact format shown above.
"""
PROBE_TIMEOUT_S = 10.0  # a model listing answers at once; waiting longer only delays the error
RETRIED_STATUSES = (408, 409, 429)  # and every 5xx


class CallFailed(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class HTTPStatusError(Exception):
    """A reply that is not a usable 200: its HTTP status, headers (for Retry-After) and body text."""

    def __init__(self, status: int, headers, text: str):
        super().__init__(f"HTTP {status}: {text[:500]}")
        self.status, self.headers = status, headers


class OpenAICoach(Coach):
    def __init__(self, model: str, base_url: str, template: str, api_key_env: str = "OPENAI_API_KEY",
                 timeout_s: float = 60.0, max_concurrency: int = 32, max_retries: int = 4, rpm: float = 0.0,
                 structured: str = "auto", format_retries: int = 2, backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0, max_tokens: int = 0, score_key: str = DEFAULT_SCORE_KEY,
                 cache: VerdictCache = None, review_template: str = None):
        if not SCORE_KEY_RE.fullmatch(score_key or ""):
            raise ValueError(f"score key {score_key!r}: use letters, digits and '_', starting with a letter")
        self.review_template = review_template or DEFAULT_REVIEW_TEMPLATE
        self.model, self.template, self.name = model, template, f"openai:{model}"
        self.max_retries, self.format_retries = max_retries, format_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.structured, self.use_schema = structured, structured != "off"
        self.rpm, self.next_slot = rpm, 0.0
        self.max_tokens = max_tokens  # 0: the server's default
        self.score_key, self.reprompt = score_key, REPROMPT.format(key=score_key)
        self.base_url, self.api_key_env = base_url.rstrip("/"), api_key_env
        self.url = self.base_url + "/chat/completions"
        self.headers = {"Authorization": f"Bearer {os.environ.get(api_key_env) or 'EMPTY'}"}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session = None  # opened on first use: an aiohttp session belongs to the loop it was made in
        # HTTP(S)_PROXY / NO_PROXY, looked up once by aiohttp's rules (its trust_env does it on a thread per
        # request). The key goes on each request, never in the session's default headers: aiohttp copies those
        # into a proxy's CONNECT, leaking it to the proxy.
        url = yarl.URL(self.url)
        try:
            self.proxy, auth = aiohttp.helpers.get_env_proxy_for_url(url)
        except LookupError:
            self.proxy, auth = None, None
        self.proxy_headers = {"Proxy-Authorization": auth.encode()} if auth else None  # CONNECT, for https
        if auth and url.scheme == "http":  # plain http goes through the proxy as is
            self.headers["Proxy-Authorization"] = auth.encode()
        self.semaphore = asyncio.Semaphore(max_concurrency)
        self.cache = cache if cache is not None else VerdictCache()

    async def score(self, request: CoachRequest) -> Verdict:
        # One slot per verdict, taken before any work and held to the end: of thousands submitted at once,
        # each is rendered and hashed just in time, not all up front while replies in flight wait for the
        # loop.
        async with self.semaphore:
            prompt = render_prompt(self.template, request)
            key = self.cache.key(self.name, prompt)
            hit = self.cache.get(key)
            if hit is not None:
                return dataclasses.replace(hit, cached=True)
            score, text, status, tally = await self.ask(prompt, lambda t: parse_score(t, self.score_key),
                                                        VERDICT_SCHEMA, self.reprompt,
                                                        "valid score in [0, 10]")
            verdict = Verdict(score=score, status=status, rationale=text, coach=self.name, **tally,
                              answer_correct=parse_answer_correct(text) if status == "ok" else None)
            if verdict.status == "ok":
                self.cache.put(key, verdict)
            return verdict

    async def reask_answer(self, verdict: Verdict) -> Verdict:
        # As the authors: the retry's ANSWER_CORRECT where it has one, and its score and text where it has a
        # score (their raw-score fallback then reads the retry's); a failed call leaves the verdict as it was.
        async with self.semaphore:
            tally = dict(latency_s=0.0, tokens_in=0, tokens_out=0, retries=1)  # the re-prompt is a retry
            prompt = ANSWER_REPROMPT.format(reply=verdict.rationale, key=self.score_key)
            try:
                text = await self.complete([{"role": "user", "content": prompt}], tally, None)
            except CallFailed:
                text = ""
            score = parse_score(text, self.score_key)
            answer = parse_answer_correct(text)
            spent = {k: getattr(verdict, k) + v for k, v in tally.items()}
            if score is not None:
                spent.update(score=score, rationale=text)
            return dataclasses.replace(verdict, answer_correct=answer, **spent)

    async def review(self, requests: list, outcome: dict) -> Review:
        # One slot, as a verdict: a review is one request.
        async with self.semaphore:
            prompt = render_review_prompt(self.review_template, requests, outcome)
            key = self.cache.key(self.name + " hindsight", prompt)
            hit = self.cache.get(key, Review)
            if hit is not None:
                return dataclasses.replace(hit, cached=True)
            n = len(requests)
            parsed, text, status, tally = await self.ask(prompt, lambda t: parse_review(t, n), REVIEW_SCHEMA,
                                                         REVIEW_REPROMPT.format(n=n),
                                                         f"valid review of the {n} actions")
            scores, responsible, rationale = parsed or (None, None, text)
            review = Review(scores, responsible, status, rationale, self.name, **tally)
            if status == "ok":
                self.cache.put(key, review)
            return review

    async def ask(self, prompt: str, parse, schema: dict, reprompt: str, wanted: str) -> tuple:
        """(parse(reply), reply, "ok", tally) for the first reply `parse` accepts, else (None, why, the
        failure's status, tally); tally: latency, tokens and retries summed over every attempt."""
        messages = [{"role": "user", "content": prompt}]
        tally = dict(latency_s=0.0, tokens_in=0, tokens_out=0, retries=0)
        for attempt in range(self.format_retries + 1):
            try:
                text = await self.complete(messages, tally, schema)
            except CallFailed as e:
                return None, str(e)[:1000], e.status, tally
            parsed = parse(text)
            if parsed is not None:
                return parsed, text, "ok", tally
            if attempt < self.format_retries:
                tally["retries"] += 1
                messages = [{"role": "user", "content": prompt + reprompt}]
        why = f"no {wanted} after {self.format_retries + 1} replies; last reply: {text[:500]!r}"
        return None, why, "parse_error", tally

    async def complete(self, messages: list, tally: dict, schema: dict) -> str:
        """One reply's text; retries transient failures, raises CallFailed when the call cannot succeed."""
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=self.timeout)
        attempt = 0
        while True:
            if self.rpm > 0:
                await self.pace()
            error = None
            # Read late: another call may have dropped it meanwhile. None: the ANSWER_CORRECT re-prompt, text
            # lines.
            use_schema = self.use_schema and schema is not None
            body = {"model": self.model, "messages": messages, "temperature": 0}
            if use_schema:
                body["response_format"] = schema
            if self.max_tokens:
                body["max_tokens"] = self.max_tokens
            start = time.perf_counter()
            try:
                post = self.session.post(self.url, json=body, headers=self.headers, proxy=self.proxy,
                                         proxy_headers=self.proxy_headers)
                async with post as reply:
                    status, headers, data = reply.status, reply.headers, await reply.read()
                text = data.decode("utf-8", errors="replace")
                if status != 200:
                    raise HTTPStatusError(status, headers, text)
                try:
                    response = json.loads(text)
                except ValueError:  # a body cut short or not JSON: a glitch, retried
                    raise HTTPStatusError(status, headers, f"reply is not JSON: {text[:200]!r}") from None
            except HTTPStatusError as e:
                if e.status == 400:
                    refused = use_schema and self.structured == "auto" and SCHEMA_WORDS.search(text)
                    if not refused:  # e.g. a prompt over the context length: retrying cannot help
                        raise CallFailed("api_error", str(e)) from None
                    # Servers without structured output answer 400 to the schema: ask again without it, and
                    # stop asking for the rest of the run (text scores parse fine).
                    if self.use_schema:
                        self.use_schema = False
                        logger.warning(
                            "coach %s: the server refused JSON-schema output; asking for text scores",
                            self.model,
                        )
                    continue
                if e.status != 200 and e.status not in RETRIED_STATUSES and e.status < 500:
                    raise CallFailed("api_error", str(e)) from None  # 401, 403, 404, ...
                error = e
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # refused, dropped, timed out
                error = e
            finally:
                tally["latency_s"] += time.perf_counter() - start
            if error is None:
                break
            if attempt >= self.max_retries:
                status = "timeout" if isinstance(error, asyncio.TimeoutError) else "api_error"
                raise CallFailed(status, f"{type(error).__name__} after {attempt + 1} attempts: {error}")
            attempt += 1
            tally["retries"] += 1
            await asyncio.sleep(self.backoff(attempt, error))

        # A reply that is JSON but lacks the expected fields reads as empty text: a parse error, re-prompted.
        response = response if isinstance(response, dict) else {}
        usage = response.get("usage") or {}
        tally["tokens_in"] += usage.get("prompt_tokens") or 0
        tally["tokens_out"] += usage.get("completion_tokens") or 0
        choices = response.get("choices") or [{}]
        message = choices[0].get("message") if isinstance(choices[0], dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        return content if isinstance(content, str) else ""

    def backoff(self, attempt: int, error: Exception) -> float:
        """Seconds before retry `attempt` (1, 2, ...): the server's Retry-After, else jittered exponential
        backoff (many requests refused together must not return together)."""
        headers = getattr(error, "headers", None) or {}
        retry_after = None
        if headers.get("retry-after-ms"):
            retry_after = float(headers["retry-after-ms"]) / 1000
        elif headers.get("retry-after"):
            value = headers["retry-after"]
            try:
                retry_after = float(value)
            except ValueError:  # an HTTP date
                date = email.utils.parsedate_to_datetime(value)
                retry_after = max(0.0, date.timestamp() - time.time()) if date else None
        if retry_after is not None:
            return retry_after * random.uniform(1.0, 1.1)
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    async def pace(self):
        """Requests-per-minute limit: each request start takes the next free slot, 60/rpm seconds apart."""
        now = time.monotonic()
        slot = max(now, self.next_slot)
        self.next_slot = slot + 60.0 / self.rpm
        await asyncio.sleep(slot - now)

    async def probe(self) -> None:
        """One GET <base_url>/models: a refused connection, a timeout, 401 or 403 raise ValueError. A listing
        without the model is only a warning: proxies and routers serve models they do not list."""
        url = self.base_url + "/models"
        # A session of its own: the probe runs in an event loop of its own, which an aiohttp session cannot
        # outlive.
        timeout = aiohttp.ClientTimeout(total=min(PROBE_TIMEOUT_S, self.timeout.total))
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                get = session.get(
                    url, headers=self.headers, proxy=self.proxy, proxy_headers=self.proxy_headers
                )
                async with get as reply:
                    status, text = reply.status, (await reply.read()).decode("utf-8", errors="replace")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ValueError(f"coach server {url} cannot be reached: {type(e).__name__}: {e}") from None
        if status in (401, 403):
            key = "set" if os.environ.get(self.api_key_env) else "NOT set"
            raise ValueError(
                f"coach server {url} refused the API key (HTTP {status}: {text[:300]}); the key is "
                f"read from ${self.api_key_env}, which is {key}"
            )
        try:
            listing = json.loads(text) if status == 200 else None
        except ValueError:
            listing = None
        models = listing.get("data") if isinstance(listing, dict) else None
        if isinstance(models, list):
            ids = [m.get("id") for m in models if isinstance(m, dict)]
            if self.model not in ids:
                logger.warning("coach server %s does not list model %r; it lists: %s", url, self.model,
                               ", ".join(map(str, ids)) or "(none)")

    async def aclose(self):
        if self.session is not None:
            await self.session.close()
            self.session = None
        self.cache.close()
