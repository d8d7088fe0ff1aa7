"""A coach behind any OpenAI-compatible chat-completions server: OpenAI, vLLM, SGLang, Ollama, a LiteLLM
proxy, Gemini's OpenAI-compatible endpoint.

One action's verdict:
  1. ask (temperature 0), with a JSON schema {rationale, score} as `response_format` where the server takes
     it ("auto": after a 400 that names the schema, ask again without it, and so for the rest of the run);
  2. transient failures (429 honouring Retry-After, 408/409, 5xx, timeouts, dropped connections, bodies that
     are not JSON) are retried
     up to `max_retries` times with jittered exponential backoff; other errors (401, 404, 400) are final;
  3. a reply without a valid 0-10 score is re-prompted at most `format_retries` times;
  4. what still fails is a Verdict with status api_error / timeout / parse_error and NO score.
"""

import asyncio
import email.utils
import logging
import os
import random
import re
import time

import openai

from openrlhf_mappa.coach import Coach, CoachRequest, parse_score, render_prompt
from openrlhf_mappa.episode import Verdict

logger = logging.getLogger(__name__)

STRUCTURED_MODES = ("auto", "json_schema", "off")
# The rationale comes first so that the coach reasons before it commits to a number.
VERDICT_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "coach_verdict",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"rationale": {"type": "string"}, "score": {"type": "number"}},
            "required": ["rationale", "score"],
            "additionalProperties": False,
        },
    },
}
SCHEMA_WORDS = re.compile(r"response_format|schema|structured|guided|grammar", re.IGNORECASE)
# A re-prompt is the original prompt plus this reminder, not a conversation with the unscorable reply in
# it: a reply that ran to the token limit, sent back, would push a small coach past its context length.
REPROMPT = (
    "\n\n(Reminder: an earlier reply to this request stated no valid score. End your reply with a line "
    "`SCORE: <number from 0 to 10>`.)"
)


class CallFailed(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def is_timeout(error: Exception) -> bool:
    """A real timeout, not a refused connection: the SDK's aiohttp transport reports both as
    APITimeoutError, and only the cause chain (ConnectionRefusedError, ...) tells them apart."""
    if not isinstance(error, openai.APITimeoutError):
        return False
    cause = error.__cause__
    while cause is not None:
        if isinstance(cause, ConnectionError):
            return False
        cause = cause.__cause__ or cause.__context__
    return True


class OpenAICoach(Coach):
    def __init__(
        self,
        model: str,
        base_url: str,
        template: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        max_concurrency: int = 32,
        max_retries: int = 4,
        rpm: float = 0.0,
        structured: str = "auto",
        format_retries: int = 2,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        max_tokens: int = 0,
    ):
        if structured not in STRUCTURED_MODES:
            raise ValueError(f"structured output mode {structured!r}: expected one of {STRUCTURED_MODES}")
        # Render once with an empty request so a template naming an unknown field fails at startup,
        # not on the first action of the first training step.
        render_prompt(template, CoachRequest("", "", 0, "", "", "", "", "", ""))
        self.model, self.template, self.name = model, template, f"openai:{model}"
        self.max_retries, self.format_retries = max_retries, format_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.structured, self.use_schema = structured, structured != "off"
        self.rpm, self.next_slot = rpm, 0.0
        self.max_tokens = max_tokens  # 0: the server's default
        # The SDK's own retries are off: ours count into the verdict and honour Retry-After with jitter.
        # aiohttp as transport costs about half the CPU per request of the default httpx one.
        self.client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=os.environ.get(api_key_env) or "EMPTY",
            timeout=timeout_s,
            max_retries=0,
            http_client=openai.DefaultAioHttpClient(timeout=timeout_s),
        )
        self.semaphore = asyncio.Semaphore(max_concurrency)

    async def score(self, request: CoachRequest) -> Verdict:
        prompt = render_prompt(self.template, request)
        messages = [{"role": "user", "content": prompt}]
        tally = dict(latency_s=0.0, tokens_in=0, tokens_out=0, retries=0)
        for attempt in range(self.format_retries + 1):
            try:
                text = await self.complete(messages, tally)
            except CallFailed as e:
                return Verdict(score=None, status=e.status, rationale=str(e)[:1000], coach=self.name, **tally)
            score = parse_score(text)
            if score is not None:
                return Verdict(score=score, status="ok", rationale=text, coach=self.name, **tally)
            if attempt < self.format_retries:
                tally["retries"] += 1
                messages = [{"role": "user", "content": prompt + REPROMPT}]
        why = f"no valid score in [0, 10] after {self.format_retries + 1} replies; last reply: {text[:500]!r}"
        return Verdict(score=None, status="parse_error", rationale=why, coach=self.name, **tally)

    async def complete(self, messages: list, tally: dict) -> str:
        """One reply's text; retries transient failures, raises CallFailed when the call cannot succeed."""
        attempt = 0
        while True:
            await self.pace()
            error = None
            async with self.semaphore:
                use_schema = self.use_schema  # read late: another call may have dropped it meanwhile
                start = time.perf_counter()
                try:
                    # The SDK's generic POST with the reply as plain JSON: its typed `chat.completions.create`
                    # spends more CPU on request transforms and response models than the whole HTTP exchange,
                    # and with thousands of verdicts per step that CPU is the coach's throughput limit.
                    body = {"model": self.model, "messages": messages, "temperature": 0}
                    if use_schema:
                        body["response_format"] = VERDICT_SCHEMA
                    if self.max_tokens:
                        body["max_tokens"] = self.max_tokens
                    response = await self.client.post("/chat/completions", body=body, cast_to=object)
                except openai.BadRequestError as e:
                    refused = use_schema and self.structured == "auto" and SCHEMA_WORDS.search(str(e))
                    if not refused:  # e.g. a prompt over the context length: retrying cannot help
                        raise CallFailed("api_error", f"{type(e).__name__}: {e}") from None
                    # Servers without structured output answer 400 to the schema: ask again without it, and
                    # stop asking for the rest of the run (text scores parse fine).
                    if self.use_schema:
                        self.use_schema = False
                        logger.warning("coach %s: the server refused JSON-schema output; asking for text scores", self.model)
                    continue
                except (openai.APITimeoutError, openai.APIConnectionError) as e:  # timeout is a subclass
                    error = e
                except ValueError as e:  # a body that is not JSON (the SDK lets json's error through): a glitch
                    error = e
                except openai.APIStatusError as e:
                    if e.status_code not in (408, 409, 429) and e.status_code < 500:
                        raise CallFailed("api_error", f"{type(e).__name__}: {e}") from None
                    error = e
                finally:
                    tally["latency_s"] += time.perf_counter() - start
            if error is None:
                break
            if attempt >= self.max_retries:
                status = "timeout" if is_timeout(error) else "api_error"
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
        """Seconds before retry `attempt` (1, 2, ...): the server's Retry-After when it sent one, else
        jittered exponential backoff, so that many requests refused together do not return together."""
        headers = getattr(getattr(error, "response", None), "headers", None) or {}
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
        if self.rpm <= 0:
            return
        now = time.monotonic()
        slot = max(now, self.next_slot)
        self.next_slot = slot + 60.0 / self.rpm
        await asyncio.sleep(slot - now)

    async def aclose(self):
        await self.client.close()
