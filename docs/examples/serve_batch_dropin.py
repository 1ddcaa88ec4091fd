"""A Ray Serve deployment written for ``@serve.batch``, switched to the adaptive batcher by its import line alone."""

import asyncio

from ray import serve
from starlette.requests import Request
from starlette.responses import StreamingResponse

from batching import batch  # was: from ray.serve import batch


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Assistant:
    @batch(max_batch_size=16, batch_wait_timeout_s=0.05)
    async def score(self, queries: list[str], documents: list[str], *, weights: list[float]) -> list[dict]:
        # One call for the whole batch: each argument arrives as a list, one entry per caller.
        return [{"score": w * len(set(q.split()) & set(d.split())), "batch": len(queries)}
                for q, d, w in zip(queries, documents, weights)]

    @batch(max_batch_size=16, batch_wait_timeout_s=0.05)
    async def generate(self, prompts: list[str]):
        # One decoding step for the whole batch per yield; a caller whose text is done gets StopIteration.
        words = [prompt.split() for prompt in prompts]
        for step in range(max(map(len, words))):
            await asyncio.sleep(0.01)
            yield [w[step].upper() if step < len(w) else StopIteration for w in words]

    async def __call__(self, request: Request):
        body = await request.json()
        if request.url.path.endswith("/generate"):
            tokens = self.generate(body["prompt"])
            return StreamingResponse((token + "\n" async for token in tokens), media_type="text/plain")
        return await self.score(body["query"], body["document"], weights=body.get("weight", 1.0))


app = Assistant.bind()
