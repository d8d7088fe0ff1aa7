"""A coach behind any OpenAI-compatible chat-completions server (a hosted API, or vLLM serving a local model)."""

import asyncio
import os
import time

import openai

from openrlhf_mappa.coach import Coach, CoachRequest, parse_score, render_prompt
from openrlhf_mappa.episode import Verdict


class OpenAICoach(Coach):
    """One chat completion per action at temperature 0. A failure becomes a non-"ok" Verdict with no score
    (parse_error, timeout, api_error), never a neutral stand-in score as in the authors' code."""

    def __init__(
        self,
        model: str,
        base_url: str,
        template: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        max_concurrency: int = 32,
    ):
        # Render once with an empty request so a template naming an unknown field fails at startup,
        # not on the first action of the first training step.
        render_prompt(template, CoachRequest("", "", 0, "", "", "", "", "", ""))
        self.model = model
        self.template = template
        self.name = f"openai:{model}"
        # Retries, caching and structured output come in a later issue: here one failed call is one verdict.
        self.client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=os.environ.get(api_key_env) or "EMPTY",
            timeout=timeout_s,
            max_retries=0,
        )
        self._semaphore = asyncio.Semaphore(max_concurrency)

    async def score(self, request: CoachRequest) -> Verdict:
        prompt = render_prompt(self.template, request)
        async with self._semaphore:
            start = time.perf_counter()
            try:
                response = await self.client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    temperature=0,
                )
            except (openai.APITimeoutError, asyncio.TimeoutError) as e:
                return self._failed("timeout", e, time.perf_counter() - start)
            except openai.APIError as e:  # HTTP error statuses and connection errors alike
                return self._failed("api_error", e, time.perf_counter() - start)
            latency = time.perf_counter() - start

        usage = response.usage
        tokens = dict(
            latency_s=latency,
            tokens_in=(usage.prompt_tokens or 0) if usage else 0,
            tokens_out=(usage.completion_tokens or 0) if usage else 0,
        )
        text = (response.choices[0].message.content if response.choices else None) or ""
        score = parse_score(text)
        if score is None:
            rationale = f"no valid SCORE in [0, 10] in the coach reply: {text[:500]!r}"
            return Verdict(score=None, status="parse_error", rationale=rationale, coach=self.name, **tokens)
        return Verdict(score=score, status="ok", rationale=text, coach=self.name, **tokens)

    def _failed(self, status: str, error: Exception, latency: float) -> Verdict:
        rationale = f"{type(error).__name__}: {error}"[:500]
        return Verdict(score=None, status=status, rationale=rationale, coach=self.name, latency_s=latency)

    async def aclose(self):
        await self.client.close()
