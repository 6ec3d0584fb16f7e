"""The local model server on a GPU (issue #43): how fast the default local model reads a prompt and writes a reply
with its layers on the GPU (RLM_LOCAL_LLM_GPU_LAYERS unset) and on the CPU (RLM_LOCAL_LLM_GPU_LAYERS=0).

    .venv/bin/python bench/gpu_local_llm.py [--model NAME] [--layers auto,0] [--requests N] [--prompt-tokens N]
        [--max-tokens N] [--logs DIR]

One run, one report (printed, and as JSON on the last line); nothing is written to RESULTS.md.  bench/gpu_run.sh
runs it on a GPU host.

For each value of ``--layers`` (``auto``: the setting unset; a number: RLM_LOCAL_LLM_GPU_LAYERS) the server is
started as every process of the product starts it (``local_llm.endpoint``, data dir bench/_data/gpu-local-llm, the
model fetched first if it is not there), warmed with one short request, then asked ``--requests`` chat completions
one at a time: a prompt of about ``--prompt-tokens`` tokens (a different slice of docs/architecture.md each time,
so that no request reuses the prompt another left in the server's cache) and exactly ``--max-tokens`` tokens out
(``ignore_eos``), at temperature 0.  The speeds are llama.cpp's own ``timings`` of each reply, median over the
requests; the seconds to start include loading the model.  Where the layers went is read off the server's log: its
``serving`` line (what was asked, and the GPUs the xllamacpp build sees) and llama.cpp's "offloaded N/M layers to
GPU".  ``--logs DIR`` keeps each run's server log there as ``server-<layers>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 - after the path tweak, before any project import

#: prose to slice prompts from: in every checkout, and long enough for a few requests of 1,500 tokens each
SOURCE = harness.REPO / "docs" / "architecture.md"
#: characters per token of that prose for these models' tokenizers, near enough: the report gives the true count
CHARS_PER_TOKEN = 3.5


def prompts(n: int, tokens: int) -> list[str]:
    """``n`` different prompts of about ``tokens`` tokens each."""
    text = " ".join(SOURCE.read_text().split())
    size = int(tokens * CHARS_PER_TOKEN)
    step = max(1, (len(text) - size) // max(1, n))
    return [f"Request {i}. Summarise this text.\n\n{text[i * step : i * step + size]}" for i in range(n)]


def ask(url: str, key: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One chat completion; llama.cpp's ``timings`` of it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # exactly max_tokens out, whatever the model would say
    }
    req = urllib.request.Request(
        f"{url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())["timings"]


def run(layers: str, model: str, texts: list[str], max_tokens: int, logs: Path | None) -> dict:
    """Start the server with ``layers``, time the requests, stop it."""
    from rlm_workers.config import get_settings, reset_settings
    from rlm_workers.runtime.local_llm import endpoint, stop_server

    if layers == "auto":
        os.environ.pop("RLM_LOCAL_LLM_GPU_LAYERS", None)
    else:
        os.environ["RLM_LOCAL_LLM_GPU_LAYERS"] = layers
    reset_settings()
    settings = get_settings()
    llm_dir = settings.data_dir / "llm"
    stop_server(settings.data_dir)  # a data dir's running server would be found and reused, whatever its layers
    log = llm_dir / "server.log"
    seen = log.stat().st_size if log.exists() else 0
    t0 = time.perf_counter()
    url, key = endpoint(settings, model)
    start_s = time.perf_counter() - t0
    written = json.loads((llm_dir / "server-config.json").read_text())
    try:
        ask(url, key, model, "Say hello.", 8)  # a first request's one-time costs (a GPU's kernels) are not timed
        timings = [ask(url, key, model, text, max_tokens) for text in texts]
    finally:
        stop_server(settings.data_dir)
    text = log.read_bytes()[seen:].decode(errors="replace")
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"server-{layers}.log").write_text(text)
    # llama.cpp's own log lines, written from its threads, may run into the launcher's line: cut at their stamp
    serving = re.search(rf"^serving {re.escape(model)} .*?(?=\s*\d+\.\d\d\.\d{{3}}\.\d{{3}} |$)", text, re.M)
    offloaded = re.findall(r"offloaded (\d+/\d+) layers to GPU", text)
    return {
        "layers": layers,
        "gpu_layers_written": written["gpu_layers"],
        "serving": serving[0] if serving else None,
        "offloaded": offloaded[-1] if offloaded else None,
        "start_s": round(start_s, 2),
        "prompt_tokens": int(statistics.median(t["prompt_n"] for t in timings)),
        "prompt_tok_s": round(statistics.median(t["prompt_per_second"] for t in timings), 1),
        "gen_tokens": int(statistics.median(t["predicted_n"] for t in timings)),
        "gen_tok_s": round(statistics.median(t["predicted_per_second"] for t in timings), 1),
        "requests": [
            {k: round(t[k], 1) for k in ("prompt_n", "prompt_per_second", "predicted_n", "predicted_per_second")}
            for t in timings
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a name of rlm_workers.runtime.local_models.MODELS (default: the stages' default)")
    ap.add_argument("--layers", default="auto,0", help="comma-separated: auto (the setting unset) or a layer count")
    ap.add_argument("--requests", type=int, default=3, help="timed requests per run")
    ap.add_argument("--prompt-tokens", type=int, default=1500, help="about this many prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=200, help="tokens written per request")
    ap.add_argument("--logs", type=Path, help="keep each run's server log in this folder")
    args = ap.parse_args()

    harness.isolated_env("gpu-local-llm")
    for var in ("OPENAI_API_KEY", "RLM_API_KEY", "OPENAI_BASE_URL", "RLM_BASE_URL"):
        os.environ.pop(var, None)
    from rlm_workers.runtime.local_llm import setup, wheel_gpus
    from rlm_workers.runtime.local_models import DEFAULT_STAGE_MODELS, resolve_model

    model = resolve_model(args.model or DEFAULT_STAGE_MODELS["subcall_model"])
    os.environ["RLM_PROVIDER"] = "local"
    os.environ["RLM_LOCAL_LLM"] = model.name  # one model, so one server process and port
    from rlm_workers.config import get_settings, reset_settings

    reset_settings()
    setup(get_settings().resolved_local_llm_dir, model, say=print)
    import xllamacpp

    out: dict = {
        "machine": harness.machine_line(),
        "revision": harness.revision(),
        "model": model.name,
        "xllamacpp": xllamacpp.__version__,
        "gpus_the_build_sees": list(wheel_gpus()),
        "runs": [],
    }
    print(f"{model.name}, xllamacpp {out['xllamacpp']}; GPUs its build sees: {out['gpus_the_build_sees'] or 'none'}")
    texts = prompts(args.requests, args.prompt_tokens)
    for layers in args.layers.split(","):
        r = run(layers.strip(), model.name, texts, args.max_tokens, args.logs)
        out["runs"].append(r)
        print(
            f"layers {r['layers']} (written {r['gpu_layers_written']}, offloaded {r['offloaded'] or 'none'}): "
            f"start {r['start_s']} s, prompt {r['prompt_tokens']} tokens at {r['prompt_tok_s']} tokens/s, "
            f"reply {r['gen_tokens']} tokens at {r['gen_tok_s']} tokens/s\n  {r['serving']}"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
