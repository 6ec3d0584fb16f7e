"""The local model server process: llama.cpp's HTTP server for one or more GGUF models, each on its own port.

``python -m rlm_workers.runtime.llm_server CONFIG`` is started, detached, by ``local_llm`` (docs/contract.md#local-llm).
``CONFIG`` is a JSON file: the models (alias, GGUF path, port), the context per slot, the slots, the threads (for
the reply and for reading the prompt), the layers of each model to put on a GPU, the API key's file and, only where
the prebuilt wheel cannot run, a ``llama-server`` binary built from source.  ``python -m
rlm_workers.runtime.llm_server --gpus`` prints, as a JSON list, the GPU devices the wheel's build can use here:
``local_llm`` asks it in a child process, so that no long-lived process opens the GPU just to find out.

With the wheel (``xllamacpp``) every model is served in this very process, so one pid stands for the whole server:
its watcher, ``rlm services stop`` and the idle stop all signal it.  With a built binary this process starts one
``llama-server`` per model and ends them when it ends.  Either way SIGTERM ends the process for certain: the wheel's
server threads would otherwise keep it alive after the main thread returned.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: more layers than any model here has: llama.cpp then puts every layer, and the output layer, on the GPU
ALL_GPU_LAYERS = 999


def gpu_devices(xllamacpp: Any) -> list[str]:
    """The GPU devices this build of the wheel can put layers on ("CUDA0 (NVIDIA H200, 140 GiB)"); none for the
    PyPI wheel, which is built for the CPU only."""
    return [
        f"{d['name']} ({d['description']}, {d['memory_total'] / 2**30:.0f} GiB)"
        for d in xllamacpp.get_device_info()
        if d["type"].name.endswith(("_GPU", "_IGPU"))
    ]


def layers_text(layers: int) -> str:
    """A count of GPU layers as the logs say it ("every layer" from ``ALL_GPU_LAYERS`` on)."""
    return "every layer" if layers >= ALL_GPU_LAYERS else f"{layers} layers"


def _placement(layers: int, gpus: list[str]) -> str:
    """Where a model runs, for the server's log."""
    if layers == 0:
        return "on the CPU (0 layers on the GPU)"
    asked = layers_text(layers)
    if not gpus:
        return f"on the CPU ({asked} asked for the GPU, but this xllamacpp build sees no GPU)"
    return f"{asked} on the GPU: {', '.join(gpus)}"


def _serve_in_process(cfg: dict[str, Any], key: str) -> list[Any]:
    import xllamacpp  # the heavy edge: a 34 MB native library, loaded only by this process

    layers = cfg["gpu_layers"]
    where = _placement(layers, gpu_devices(xllamacpp) if layers else [])
    servers = []
    for m in cfg["models"]:
        p = xllamacpp.CommonParams()
        p.model.path = m["path"]
        p.model_alias = {m["alias"]}
        p.hostnames = ["127.0.0.1"]
        p.port = m["port"]
        # the context is shared by the slots: each request gets ctx_per_slot tokens
        p.n_ctx = cfg["ctx_per_slot"] * cfg["parallel"]
        p.n_parallel = cfg["parallel"]
        p.cpuparams.n_threads = cfg["threads"]  # writing the reply, a token at a time
        p.cpuparams_batch.n_threads = cfg["batch_threads"]  # reading the prompt
        p.n_gpu_layers = layers
        # 0 means the CPU: a GPU build would still send a long prompt's matrix products to the GPU (op offload)
        p.no_op_offload = layers == 0
        p.use_jinja = True  # the model's own chat template
        p.api_keys = [key]
        p.ui = False
        p.endpoint_slots = True  # GET /slots: the provider waits for an idle slot before it retries
        servers.append(xllamacpp.Server(p))
        print(f"serving {m['alias']} on 127.0.0.1:{m['port']}, {where}", flush=True)
    return servers


def _serve_binaries(cfg: dict[str, Any]) -> list[subprocess.Popen]:
    procs = []
    for m in cfg["models"]:
        argv = [
            cfg["binary"],
            "--model",
            m["path"],
            "--alias",
            m["alias"],
            "--host",
            "127.0.0.1",
            "--port",
            str(m["port"]),
            "--ctx-size",
            str(cfg["ctx_per_slot"] * cfg["parallel"]),
            "--parallel",
            str(cfg["parallel"]),
            "--threads",
            str(cfg["threads"]),
            "--threads-batch",
            str(cfg["batch_threads"]),
            # built for the CPU (local_llm.build_server): more than 0 only where the setting asks, and then ignored
            "--n-gpu-layers",
            str(cfg["gpu_layers"]),
            # the key lives in a 0600 file, never on the command line every local user can read in `ps`
            "--api-key-file",
            cfg["key_file"],
            "--jinja",
            "--no-webui",
        ]
        procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
    return procs


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m rlm_workers.runtime.llm_server CONFIG | --gpus")
    if args[0] == "--gpus":
        import xllamacpp

        print(json.dumps(gpu_devices(xllamacpp)), flush=True)
        return
    cfg = json.loads(Path(args[0]).read_text())
    children: list[subprocess.Popen] = []

    def end(*_: object, code: int = 0) -> None:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
        os._exit(code)  # not sys.exit: the wheel's server threads would keep the process alive

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    if cfg.get("binary"):
        children = _serve_binaries(cfg)
        while all(c.poll() is None for c in children):
            time.sleep(0.5)
        failed = next(c for c in children if c.poll() is not None)
        print(f"llama-server exited with {failed.returncode}", flush=True)
        end(code=1)
    key = Path(cfg["key_file"]).read_text().strip()
    _keep = _serve_in_process(cfg, key)  # noqa: F841 - the servers live as long as their objects
    while True:
        signal.pause()


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    main()
