"""`graphrt serve` against offline greedy decoding, through the official openai client.

Starts the server (flags after ``--`` go to `graphrt serve`; default: the embedded pair,
drafting, float32), streams held-out code prompts to it from concurrent clients, and
compares every stream's tokens (vLLM's ``return_token_ids``) and text with offline
``LLM.generate`` of the same prompts on the same device without drafting. Prints one
line per prompt and a verdict; exits 1 on any difference.

    python bench/serve_check.py --prompts 8 --max-tokens 64 -- --dtype float32
"""

from __future__ import annotations

import argparse
import random
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
from serve_load import code_tokens, server_metrics, start_server


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else ["--dtype", "float32"]
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(own)

    rng = random.Random(0)
    code = [f for f in code_tokens() if len(f) > args.prompt_len]
    prompts = []
    for _ in range(args.prompts):
        ids = rng.choice(code)
        start = rng.randrange(0, len(ids) - args.prompt_len)
        prompts.append(ids[start : start + args.prompt_len])

    proc, url, _ = start_server(serve_args, timeout=600)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id

        def stream(prompt):
            chunks = client.completions.create(
                model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                stream=True, extra_body={"return_token_ids": True},
            )  # fmt: skip
            ids, text = [], []
            for chunk in chunks:
                for c in chunk.choices:
                    ids += c.token_ids or []
                    text.append(c.text or "")
            return ids, "".join(text)

        with ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(stream, prompts))
        metrics = server_metrics(url)
    finally:
        proc.terminate()
        proc.wait(timeout=120)

    from graphrt.core.models.config import parse_dtype
    from graphrt.core.serve import LLM, TextParams

    dtype = serve_args[serve_args.index("--dtype") + 1] if "--dtype" in serve_args else "auto"
    model_dir = serve_args[serve_args.index("--model") + 1] if "--model" in serve_args else None
    offline = LLM(model_dir, draft=False, dtype=None if dtype == "auto" else parse_dtype(dtype))
    want = offline.generate(prompts, TextParams(max_tokens=args.max_tokens))
    same = 0
    for i, ((ids, text), w) in enumerate(zip(served, want)):
        ok = ids == w.token_ids and text == w.text
        same += ok
        first = next((j for j, (a, b) in enumerate(zip(ids, w.token_ids)) if a != b), None)
        print(f"prompt {i}: {len(ids)} tokens, {'equal' if ok else f'differs at {first}'}")
    drafts = metrics.get("graphrt:spec_decode_num_drafts_total", 0)
    accepted = metrics.get("graphrt:spec_decode_num_accepted_tokens_total", 0)
    accept = f"{1 + accepted / drafts:.2f}" if drafts else "-"
    print(
        f"served == offline greedy without drafting: {same}/{len(prompts)} "
        f"({model}, serve {' '.join(serve_args)}; {int(drafts)} speculative rounds, "
        f"accept length {accept})"
    )
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
