"""What a small local model gets instead of a hosted one's defaults (docs/contract.md#providers,
docs/contract.md#local-llm): who answers, the JSON actions and answering analysts it is asked for, the evidence
its answers are pointed back at, and replies, batches and timeouts sized to it.  Pure: no server, no database."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlm_workers.config import Settings
from rlm_workers.errors import ParseError
from rlm_workers.llm.openai_provider import _SPEEDS, OpenAIProvider, _learn_speed
from rlm_workers.llm.protocol import CompletionRequest
from rlm_workers.llm.stage_input import ChunkForPrompt, Question, ReadInput, ShownFinding
from rlm_workers.llm.structured import action_schema, batch_answer_schema
from rlm_workers.pipeline.analyst import answer_entries, parse_findings, render_messages
from rlm_workers.pipeline.evidence import evidence_lines, grounded
from rlm_workers.pipeline.params import make_batches
from rlm_workers.pipeline.route import analyst_batch_tokens, analyst_reply_tokens
from rlm_workers.pipeline.synthesize import _report_of
from rlm_workers.runtime.local_models import (
    DEFAULT_STAGE_MODELS,
    MODELS,
    gpu_driver_present,
    host_problem,
    resolve_model,
    wheel_problem,
)

LOCAL = "qwen2.5-coder-0.5b"


def _chunk(cid: int, text: str, path: str = "a.md", start: int = 1) -> ChunkForPrompt:
    lines = text.count("\n") + 1
    return ChunkForPrompt(chunk_id=cid, buffer="b", path=path, start_line=start, end_line=start + lines - 1, text=text)


# ---------------------------------------------------------------- where the local model server runs


def test_every_layer_goes_to_a_gpu_only_where_the_wheels_build_sees_one(tmp_path, monkeypatch):
    """RLM_LOCAL_LLM_GPU_LAYERS when set; unset, all where the wheel lists a GPU (simulated here), else 0."""
    from rlm_workers.runtime import local_llm
    from rlm_workers.runtime.llm_server import ALL_GPU_LAYERS

    def layers(**given) -> int:
        return local_llm.gpu_layers(Settings(local_llm_dir=tmp_path, **given))

    monkeypatch.setattr(local_llm, "wheel_problem", lambda: None)
    monkeypatch.setattr(local_llm, "wheel_gpus", lambda: ("CUDA0 (NVIDIA H200, 140 GiB)",))
    assert (layers(), layers(local_llm_gpu_layers=0), layers(local_llm_gpu_layers=12)) == (ALL_GPU_LAYERS, 0, 12)
    monkeypatch.setattr(local_llm, "wheel_gpus", lambda: ())
    assert (layers(), layers(local_llm_gpu_layers=12)) == (0, 12)
    # the source-built fallback is built for the CPU: a GPU the wheel would see does not count
    monkeypatch.setattr(local_llm, "wheel_problem", lambda: "this CPU lacks AVX2")
    monkeypatch.setattr(local_llm, "wheel_gpus", lambda: ("CUDA0 (NVIDIA H200, 140 GiB)",))
    assert layers() == 0


def test_the_gpu_probe_asks_the_wheel_only_beside_a_driver_and_never_fails(monkeypatch):
    """Without a GPU driver nothing is started to ask; beside one, the installed wheel is asked in a child process,
    and a probe that fails or hangs means the CPU."""
    import subprocess

    from rlm_workers.runtime import local_llm

    if wheel_problem():
        pytest.skip(f"the prebuilt local model server cannot run here: {wheel_problem()}")
    probe = local_llm.wheel_gpus.__wrapped__  # uncached: each case asks again
    real_run = subprocess.run

    def no_child(*args, **kwargs):
        raise AssertionError("a child process was started")

    monkeypatch.setattr(local_llm, "gpu_driver_present", lambda: False)
    monkeypatch.setattr(subprocess, "run", no_child)
    assert probe() == ()
    monkeypatch.setattr(subprocess, "run", real_run)
    monkeypatch.setattr(local_llm, "gpu_driver_present", lambda: True)
    found = probe()  # the real wheel, asked as on a GPU host
    assert isinstance(found, tuple) and all(isinstance(d, str) for d in found)
    if not gpu_driver_present():  # no build sees a GPU on a host without its driver
        assert found == ()
    monkeypatch.setattr(local_llm, "GPU_PROBE_SECONDS", 0.001)
    assert probe() == ()


def test_only_gpu_devices_count_and_the_servers_log_says_where_a_model_runs():
    from rlm_workers.runtime.llm_server import ALL_GPU_LAYERS, _placement, gpu_devices

    def kind(name: str) -> SimpleNamespace:
        return SimpleNamespace(name=f"GGML_BACKEND_DEVICE_TYPE_{name}")

    listed = [
        {"name": "CPU", "description": "AMD EPYC", "memory_total": 64 * 2**30, "type": kind("CPU")},
        {"name": "CUDA0", "description": "NVIDIA H200", "memory_total": 140 * 2**30, "type": kind("GPU")},
    ]
    gpus = gpu_devices(SimpleNamespace(get_device_info=lambda: listed))
    assert gpus == ["CUDA0 (NVIDIA H200, 140 GiB)"]
    assert _placement(ALL_GPU_LAYERS, gpus) == "every layer on the GPU: CUDA0 (NVIDIA H200, 140 GiB)"
    assert _placement(12, gpus) == "12 layers on the GPU: CUDA0 (NVIDIA H200, 140 GiB)"
    assert _placement(0, gpus) == "on the CPU (0 layers on the GPU)"
    assert _placement(12, []) == "on the CPU (12 layers asked for the GPU, but this xllamacpp build sees no GPU)"


def test_a_bad_gpu_layer_count_is_an_invalid_setting(monkeypatch):
    from rlm_workers.config import load_settings
    from rlm_workers.errors import ConfigError

    for value in ("-1", "abc", "1000001"):
        monkeypatch.setenv("RLM_LOCAL_LLM_GPU_LAYERS", value)
        with pytest.raises(ConfigError) as ei:
            load_settings()
        assert (
            ei.value.message.startswith("invalid setting RLM_LOCAL_LLM_GPU_LAYERS: ") and "\n" not in ei.value.message
        )
    monkeypatch.setenv("RLM_LOCAL_LLM_GPU_LAYERS", "0")
    assert load_settings().local_llm_gpu_layers == 0


# ---------------------------------------------------------------- who answers


def test_a_key_or_base_url_means_openai_a_named_model_means_local_off_means_extractive(tmp_path):
    cache = {"local_llm_dir": tmp_path}
    assert Settings(api_key="sk", **cache).resolved_provider == "openai"
    assert Settings(base_url="http://h/v1", local_llm=LOCAL, **cache).resolved_provider == "openai"
    named = Settings(local_llm=LOCAL, **cache)
    assert named.resolved_provider == "local" and named.local_models == [LOCAL]
    assert (named.primary_model, named.subcall_model, named.synthesizer_model) == (LOCAL,) * 3
    off = Settings(local_llm="off", **cache)
    assert off.resolved_provider == "extractive" and off.offline and "off" in off.local_problem
    assert Settings(provider="extractive", local_llm=LOCAL, **cache).offline
    assert Settings(provider="local", local_llm="off", **cache).local_models == sorted(
        set(DEFAULT_STAGE_MODELS.values())
    )


def test_auto_picks_the_default_local_models_where_the_machine_can_serve_them(tmp_path):
    settings = Settings(local_llm=None, **{"local_llm_dir": tmp_path})
    problem = host_problem(tmp_path, {resolve_model(m) for m in DEFAULT_STAGE_MODELS.values()})
    if problem is None:
        assert settings.resolved_provider == "local" and settings.local_problem is None
        assert set(settings.local_models) == set(DEFAULT_STAGE_MODELS.values())
        # the small model's defaults, unless set
        assert settings.max_concurrency == settings.local_llm_parallel and settings.model_context
    else:  # this host cannot: auto says why and the extractive provider answers
        assert settings.resolved_provider == "extractive" and settings.local_problem == problem


def test_a_local_model_gets_json_actions_answering_analysts_and_no_planner_call(tmp_path):
    local = Settings(local_llm=LOCAL, local_llm_dir=tmp_path)
    assert local.json_tool_calls(LOCAL) and local.answering_analysts(LOCAL) and not local.plans_with_model(LOCAL)
    hosted = Settings(api_key="sk", local_llm_dir=tmp_path)
    model = hosted.synthesizer_model
    assert not hosted.json_tool_calls(model) and not hosted.answering_analysts(model) and hosted.plans_with_model(model)
    forced = Settings(
        api_key="sk", tool_calls="json", analyst_findings="answers", planner="defaults", local_llm_dir=tmp_path
    )
    assert forced.json_tool_calls(model) and forced.answering_analysts(model) and not forced.plans_with_model(model)


def test_every_local_model_is_pinned_and_sized():
    for m in MODELS.values():
        assert len(m.sha256) == 64 and m.packages and m.size_mb > 0
    assert set(DEFAULT_STAGE_MODELS.values()) <= set(MODELS)


# ---------------------------------------------------------------- answering analysts and their evidence

MIRROR = _chunk(
    7,
    "# The telescope\n\nThe dome opened in 1981 after a long delay.\nIts primary mirror is 2.4 metres across and was "
    "cast in 1980.\nVisitors may not enter the dome at night.",
    path="scope.md",
)
ARCHIVE = _chunk(8, "# Archive\n\nThe archive holds 3.2 petabytes of processed images.", path="archive.md", start=1)
READ = ReadInput((MIRROR, ARCHIVE), (Question("How wide is the main mirror?", ()),))


def test_an_answer_is_a_pointer_the_finding_is_the_files_own_line():
    """A small model's misread value ("1.4") is not what is stored: the chunk's best-matching line is."""
    entries = answer_entries('{"answer": "1.4 metres across", "cited_chunks": [7]}', [7, 8], READ)
    by_id = {e["chunk_id"]: e for e in entries}
    assert by_id[7]["relevance"] == "high" and by_id[8]["relevance"] == "none"
    assert by_id[7]["findings"][0] == "line 4: Its primary mirror is 2.4 metres across and was cast in 1980."
    assert all("1.4" not in f for e in entries for f in e["findings"])


def test_an_answer_the_chunks_do_not_hold_grades_no_chunk_high():
    """An answer citing the mirror's chunk with words neither chunk holds is no evidence: no chunk is graded high;
    the line that best matches the question itself is still kept, graded low, and the archive's is not."""
    entries = answer_entries('{"answer": "It is 1.2 gigaparsecs wide", "cited_chunks": [7]}', [7, 8], READ)
    by_id = {e["chunk_id"]: e for e in entries}
    assert (by_id[7]["relevance"], by_id[8]["relevance"]) == ("low", "none")
    assert by_id[7]["findings"] == ["line 4: Its primary mirror is 2.4 metres across and was cast in 1980."]
    empty = answer_entries('{"answer": "", "cited_chunks": [7]}', [7, 8], READ)
    assert [e["relevance"] for e in empty] == ["low", "none"]


def test_a_misread_citation_is_grounded_in_the_chunk_that_holds_the_answer():
    assert grounded("the archive keeps petabytes of processed images", "How much?", [MIRROR, ARCHIVE], [7]) == {8}
    assert grounded("", "How wide is the main mirror?", [MIRROR, ARCHIVE], [7]) == set()
    # a count is never written out: an answer that is a number is taken at its citation
    assert grounded("four", "How many?", [MIRROR, ARCHIVE], [8]) == {8} == grounded("4", "How many?", [ARCHIVE], [8])
    lines = evidence_lines("How wide is the main mirror? 2.4 metres", [MIRROR, ARCHIVE], {7})
    assert list(lines) == [7] and lines[7][0].startswith("line 4: ")


def test_a_value_the_answer_reads_off_the_page_points_at_the_chunk_that_writes_it():
    """Two chunks of one file share every word of the answer; only one writes its number.  A number no chunk
    writes (a count, a misreading) points nowhere, and a lone digit is a count, taken at its citation."""
    top = _chunk(
        20, "Sentinel settings, in seconds where timed.\nThe default port is set below.\nSee the table.", path="conf.py"
    )
    below = _chunk(21, "DEFAULT_PORT = 26379\nThe default retry delay is 5.0 seconds.", path="conf.py", start=4)
    assert grounded("26379", "Which port by default?", [top, below], [20]) == {21}
    assert grounded("The default port is 26,379", "Which port?", [top, below], [20]) == {21}
    assert grounded("The default port is 6380", "Which port?", [top, below], [20]) == {20}
    assert grounded("5 seconds", "How long is the retry delay?", [top, below, MIRROR], [20]) == {21}
    assert grounded("5", "How many settings?", [top, below], [20]) == {20}


def test_a_wrapped_sentence_is_quoted_with_its_subject_and_a_list_whole_with_its_introduction():
    """Text wrapped at 80 columns leaves a value's subject on the line above, and one item of a list cannot be
    counted: the quote runs to the sentence's start and over the whole list, and stops at the paragraph."""
    kilns = _chunk(
        3,
        "# Kilns\n\nThe old kiln was built in 1871 by the parish.\nThe glass kiln is fired with beech wood and"
        "\nreaches 1,150 degrees at its hottest. It cools over three days.\nNobody may enter it when lit.\n\n"
        "Before a firing, the keeper checks:\n\n- the flue\n- the door seal\n- the wood store\n\nThat is all.",
        path="kilns.md",
    )
    heat = evidence_lines("How hot does it get? 1,150 degrees", [kilns], {3}, per_chunk=1)[3]
    assert heat == [
        "lines 4-5:\n  The glass kiln is fired with beech wood and\n  reaches 1,150 degrees at its hottest. It cools "
        "over three days."
    ]
    # both of its best lines are in that one sentence: it is quoted once
    assert evidence_lines("glass kiln beech wood 1,150 degrees", [kilns], {3})[3] == heat
    checks = evidence_lines("How many things does the keeper check before a firing?", [kilns], {3}, per_chunk=1)[3]
    listed = "lines 8-12 (a list of 3 items):\n  Before a firing, the keeper checks:\n  - the flue\n  - the door seal"
    assert checks == [listed + "\n  - the wood store"]
    item = evidence_lines("the door seal", [kilns], {3}, per_chunk=1)[3]
    assert item == checks  # an item: the whole list, with the line that introduces it


def test_an_answering_analysts_reply_parses_to_findings_and_a_bad_one_is_a_parse_error():
    found = parse_findings('{"answer": "2.4 metres", "cited_chunks": [7]}', batch_chunk_ids=[7, 8], read=READ)
    assert [(f.chunk_id, str(f.relevance)) for f in found] == [(7, "high"), (8, "none")]
    with pytest.raises(ParseError):
        parse_findings("I think it is big", batch_chunk_ids=[7, 8], read=READ)


def test_an_answering_analyst_is_asked_for_one_answer_citing_only_its_batch():
    schema = batch_answer_schema([8, 7])["schema"]
    assert schema["required"] == ["answer", "cited_chunks"]
    assert schema["properties"]["cited_chunks"]["items"] == {"enum": [7, 8]}
    assert schema["properties"]["cited_chunks"]["minItems"] == 1
    user = render_messages("SYS", READ, answering=True)[1]["content"]
    assert user.index("## Chunks") < user.index("## Query") < user.index('{"answer"')


# ---------------------------------------------------------------- the synthesizer's JSON actions


def test_a_json_action_reply_offers_each_tool_or_the_answer_object():
    tools = [{"type": "function", "function": {"name": "get_chunks", "parameters": {"type": "object"}}}]
    answer = {"name": "answer", "schema": {"type": "object", "properties": {"answer": {"type": "string"}}}}
    options = action_schema(tools, answer=answer)["schema"]["anyOf"]
    assert options[0]["properties"]["action"] == {"type": "string", "enum": ["get_chunks"]}
    assert options[-1] == answer["schema"]


def test_the_synthesizers_answer_object_is_rendered_with_its_citations():
    shown = {7: ShownFinding(chunk_id=7, buffer="b", path="scope.md", start_line=1, end_line=6, relevance="high")}
    report = _report_of('{"answer": "It is 2.4 metres across.", "cited_chunks": [7, 99]}', {"search"}, shown)
    assert report == "It is 2.4 metres across.\n\nSources: [chunk 7, scope.md:1-6]"
    assert _report_of('{"action": "get_chunks", "arguments": {}}', set(), shown) is None  # a call not offered
    assert _report_of("## A plain report", set(), shown) == "## A plain report"


# ---------------------------------------------------------------- sized to the model


def test_replies_and_batches_are_sized_to_a_small_context():
    small = Settings(local_llm=LOCAL, local_llm_ctx=8192)
    assert analyst_reply_tokens(4, small) == 4 * 256 + 64
    assert analyst_reply_tokens(4, small, records=True) == 8 * 256 + 64
    assert analyst_reply_tokens(4, Settings(api_key="sk")) == 4 * 1024 + 64
    room = analyst_batch_tokens(4, small)
    assert room is not None and room < 8192 and analyst_batch_tokens(4, Settings(api_key="sk")) is None
    tokens = {1: 3000, 2: 3000, 3: 100, 4: 100, 5: 100}
    assert make_batches([1, 2, 3, 4, 5], batch_size=4, tokens=tokens, max_tokens=5000) == [[1], [2, 3, 4, 5]]
    assert make_batches([1, 2, 3, 4, 5], batch_size=2) == [[1, 2], [3, 4], [5]]


def test_a_local_models_timeout_follows_the_pace_its_server_reports():
    settings = Settings(local_llm=LOCAL)
    provider = OpenAIProvider(settings)
    request = CompletionRequest(
        role="analyst", model=LOCAL, messages=[{"role": "user", "content": "x" * 4000}], max_tokens=100
    )
    _SPEEDS.pop(LOCAL, None)
    # the settings' allowance until the server has said its pace
    estimate = len(json.dumps(request.messages)) // 4 + request.max_tokens
    assert provider.attempt_timeout(request) == pytest.approx(
        settings.llm_timeout + settings.llm_seconds_per_1k_tokens * estimate / 1000
    )
    reply = SimpleNamespace(
        model_extra={
            "timings": {"prompt_n": 500, "prompt_per_second": 50.0, "predicted_n": 50, "predicted_per_second": 10.0}
        }
    )
    _learn_speed(LOCAL, reply)
    measured = provider.attempt_timeout(request)
    prompt = len(json.dumps(request.messages)) // 4
    assert measured == pytest.approx(60 + 2 * settings.local_llm_parallel * (prompt / 50 + 100 / 10))
    slower = SimpleNamespace(
        model_extra={
            "timings": {"prompt_n": 500, "prompt_per_second": 10.0, "predicted_n": 50, "predicted_per_second": 2.0}
        }
    )
    _learn_speed(LOCAL, slower)
    assert provider.attempt_timeout(request) > measured
    _SPEEDS.pop(LOCAL, None)
