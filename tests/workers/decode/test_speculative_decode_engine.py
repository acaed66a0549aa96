"""Speculative decoding in the decode worker (workers/decode/speculative_step.py) against the
offline engine without speculation (same tiny checkpoint with an MTP layer, fp32, CPU):
colocated requests, greedy and seeded sampling, equal token for token with the tiny MTP layer
trained so drafts are accepted; PD requests when both workers hold the MTP layer; a prefill
without it is refused at the handshake (the KV layouts differ by the MTP layer); the pools end empty."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.speculative.policy import SpeculationPolicy, StepCosts
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.workers.engine.interface import DisaggParams, Failed, GenerateRequest
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.decode.engine import DecodeEngine
from deepseek_pd.workers.prefill.engine import PrefillEngine
from deepseek_pd.model.speculative.training import train_mtp
from pdtest.pd_engine_harness import CHUNK, PAGE_SIZE, abort_after_first_event, collect, pages_back, worker_config

pytestmark = [pytest.mark.timeout(300)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    seed = random.randrange(1000)
    print(f"seed={seed}")
    path = str(make_tiny_model(tmp_path_factory.mktemp("spec-worker") / "v3", seed=seed, mtp_layers=1))
    oracle = Engine(path, page_size=PAGE_SIZE, chunked_prefill_size=CHUNK)
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, oracle.vocab_size) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    sequences = [p + r.output_ids for p, r in zip(prompts, oracle.generate_batch(prompts, GREEDY))]
    trained = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256, speculative_num_steps=3))
    accuracy, steps = train_mtp(trained, sequences, seconds=15.0)
    print(f"MTP training: {steps} steps, accuracy {accuracy:.3f}")
    return path, oracle, trained, prompts, rng


def _spec_runner(path: str, trained: ModelRunner, enable_tbo: bool = False) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256, speculative_num_steps=3,
                                      enable_tbo=enable_tbo))
    runner.model.mtp.load_state_dict(trained.model.mtp.state_dict())
    return runner


def _colocated(runner: ModelRunner, oracle: Engine, requests: list[GenerateRequest], metrics=None, prepare=None):
    """Runs `requests` at once through one speculative decode engine (colocated, no PD): their
    outcomes and the engine's speculation stats; the pool and the page budget end empty.
    `prepare(engine)` runs once the engine has started, before the requests."""
    async def run():
        engine = DecodeEngine(runner, worker_config("fake"), tokenizer=oracle.tokenizer, metrics=metrics)
        await engine.start()
        try:
            if prepare is not None:
                prepare(engine)
            outcomes = await asyncio.gather(*(collect(engine, request) for request in requests))
            await pages_back(engine)  # a request that ended while a step was in flight: its next round
            return outcomes, engine.speculation.stats
        finally:
            await engine.stop()
    return asyncio.run(run())


def test_colocated_speculative_equals_offline(setup):
    path, oracle, trained, prompts, rng = setup
    extra = [[rng.randrange(2, oracle.vocab_size) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    params = [GREEDY] * (len(prompts) + len(extra))
    params += [SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=12, ignore_eos=True, seed=rng.randrange(1 << 20))
               for _ in prompts]
    params += [dataclasses.replace(GREEDY, max_new_tokens=rng.randint(1, 5)) for _ in extra]
    all_prompts = (prompts + extra) * 2
    expected = oracle.generate_batch(all_prompts, params)

    metrics = WorkerMetrics()
    requests = [GenerateRequest(f"c{i}", tuple(p), sp, return_logprob=True)
                for i, (p, sp) in enumerate(zip(all_prompts, params))]
    outcomes, stats = _colocated(_spec_runner(path, trained), oracle, requests, metrics=metrics)
    sample = metrics.registry.get_sample_value
    assert sample("deepseek_pd:spec_draft_tokens_total", metrics.labels.values()) == stats.drafted
    assert sample("deepseek_pd:spec_accepted_tokens_total", metrics.labels.values()) == stats.accepted
    assert sample("deepseek_pd:spec_accept_length_count", metrics.labels.values()) == stats.verify_rows
    assert sample("deepseek_pd:spec_accept_length_sum", metrics.labels.values()) == stats.emitted
    for outcome, want in zip(outcomes, expected):
        assert outcome.ok and outcome.tokens == want.output_ids
        assert all(abs(a - b) < 1e-4 for a, b in zip(outcome.logprobs, want.output_logprobs))
    print(f"worker accept length {stats.accept_length:.2f} ({dict(sorted(stats.histogram.items()))})")
    assert stats.accept_length > 1.2  # measured 1.34-1.41: the trained prompts among untrained and sampled ones


def _pd(prefill_runner: ModelRunner, decode_runner: ModelRunner, oracle: Engine, prompts, transport: str):
    async def run():
        prefill = PrefillEngine(prefill_runner, worker_config(transport))
        decode = DecodeEngine(decode_runner, worker_config(transport), tokenizer=oracle.tokenizer)
        await prefill.start()
        await decode.start()
        try:
            outcomes = []
            for i, prompt in enumerate(prompts):
                disagg = DisaggParams("127.0.0.1", prefill.bootstrap_port, 5000 + i)
                base = GenerateRequest(rid=f"r{i}", input_ids=tuple(prompt), sampling=GREEDY, disagg=disagg)
                outcomes.append(await asyncio.gather(collect(prefill, dataclasses.replace(base, rid=f"r{i}-p")),
                                                     collect(decode, dataclasses.replace(base, rid=f"r{i}-d"))))
            await pages_back(decode)
            return outcomes, decode.speculation.stats
        finally:
            await decode.stop()
            await prefill.stop()
    return asyncio.run(run())


@pytest.mark.parametrize("transport", ["fake", "grpc"])
def test_pd_with_mtp_on_both_sides_equals_offline(setup, transport):
    path, oracle, trained, prompts, _ = setup
    expected = oracle.generate_batch(prompts, GREEDY)
    # The prefill worker runs the (trained) MTP layer over each prompt and sends its KV with the rest.
    decode_runner = _spec_runner(path, trained)
    outcomes, stats = _pd(_spec_runner(path, trained), decode_runner, oracle, prompts, transport)
    for (p_out, d_out), want in zip(outcomes, expected):
        assert p_out.ok and d_out.ok, (p_out.terminal, d_out.terminal)
        assert d_out.tokens == want.output_ids
    print(f"PD accept length {stats.accept_length:.2f} ({dict(sorted(stats.histogram.items()))})")
    # the first draft comes over the wire, the rest from the transferred MTP KV: the memorised
    # prompts accept most drafts
    assert stats.accept_length > 1.8


def test_pd_prefix_cache_hits_with_mtp_equal_offline(setup):
    """Prompts that extend an earlier one hit the prefill's prefix cache, whose pages carry the MTP
    layer's KV as the first request left it (its last position saw that request's first token):
    only the drafts can suffer, the output cannot."""
    path, oracle, trained, prompts, rng = setup
    longest = max(prompts, key=len)
    batch = [longest] + [longest + [rng.randrange(2, oracle.vocab_size) for _ in range(n)] for n in (3, 9)]
    expected = oracle.generate_batch(batch, GREEDY)
    outcomes, _ = _pd(_spec_runner(path, trained), _spec_runner(path, trained), oracle, batch, "grpc")
    for (p_out, d_out), want in zip(outcomes, expected):
        assert p_out.ok and d_out.ok and d_out.tokens == want.output_ids
    assert all(p_out.terminal.cached_tokens > 0 for p_out, _ in outcomes[1:])


def test_prefill_without_the_mtp_layer_is_refused(setup):
    path, oracle, trained, prompts, _ = setup
    plain = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256))
    ((p_out, d_out),), _ = _pd(plain, _spec_runner(path, trained), oracle, prompts[:1], "grpc")
    assert isinstance(d_out.terminal, Failed) and isinstance(p_out.terminal, Failed)
    print(d_out.terminal.message)
    assert "layers=5" in d_out.terminal.message and "--speculative-num-steps" in d_out.terminal.message


def test_pd_transfers_the_mtp_layers_prompt_kv(setup):
    """The decode pool's MTP-layer KV of a PD prompt, at its first speculative step, is what the MTP
    layer computes over that prompt (the prefill worker ran it and the transfer carried it), and so
    is the first draft that came in TransferDone."""
    path, oracle, trained, prompts, _ = setup
    prompt = max(prompts, key=len)
    decode_runner = _spec_runner(path, trained)
    layer = decode_runner.model.mtp.layer_id
    seen = {}
    engine_launch = None

    # On `launch`, which every step goes through (`step`, and the overlapped `collect_and_launch`):
    # the first step's rows, before it seeds the wire draft.
    def spy(rows, *args, **kwargs):
        if not seen:
            row = rows[0]
            pool = decode_runner.kv_pool
            slots = pool.slots(row.pages, torch.arange(len(prompt)))
            seen["kv"] = pool.flat(layer)[slots].clone()
            seen["first"] = row.output_ids[0]
            seen["wire_draft"] = row.wire_draft
        return engine_launch(rows, *args, **kwargs)

    async def patch_and_run():
        nonlocal engine_launch
        prefill = PrefillEngine(_spec_runner(path, trained), worker_config("fake"))
        decode = DecodeEngine(decode_runner, worker_config("fake"), tokenizer=oracle.tokenizer)
        engine_launch, decode.speculation.launch = decode.speculation.launch, spy
        await prefill.start()
        await decode.start()
        try:
            disagg = DisaggParams("127.0.0.1", prefill.bootstrap_port, 7777)
            base = GenerateRequest(rid="kv", input_ids=tuple(prompt), sampling=GREEDY, disagg=disagg)
            return await asyncio.gather(collect(prefill, dataclasses.replace(base, rid="kv-p")),
                                        collect(decode, dataclasses.replace(base, rid="kv-d")))
        finally:
            await decode.stop()
            await prefill.stop()

    p_out, d_out = asyncio.run(patch_and_run())
    assert p_out.ok and d_out.ok
    # the oracle: one MTP pass over the whole prompt in a runner of its own
    oracle_runner = _spec_runner(path, trained)
    pool = oracle_runner.kv_pool
    pages = pool.alloc(pool.pages_for_tokens(len(prompt)))
    hidden = oracle_runner.extend_hidden([ExtendSeq(prompt, 0, pages)])
    mtp_out = oracle_runner.draft([ExtendSeq(prompt[1:] + [seen["first"]], 0, pages)], hidden)
    want = pool.flat(layer)[pool.slots(pages, torch.arange(len(prompt)))]
    torch.testing.assert_close(seen["kv"], want, atol=1e-4, rtol=1e-4)
    # and the first draft came over the wire: the MTP layer's token and hidden state at the last position
    token, wire_hidden = seen["wire_draft"]
    assert token == int(oracle_runner.logits(mtp_out[-1:]).argmax())
    torch.testing.assert_close(torch.tensor(wire_hidden), mtp_out[-1], atol=1e-4, rtol=1e-4)


def test_a_malformed_wire_draft_is_ignored():
    from deepseek_pd.proto import bootstrap_pb2 as pb
    from deepseek_pd.workers.decode.speculative_step import wire_draft

    good = pb.TransferDone(mtp_draft_token_id=7, mtp_hidden=[0.5] * 4)
    assert wire_draft(good, vocab_size=10, hidden_size=4) == (7, [0.5] * 4)
    assert wire_draft(pb.TransferDone(), vocab_size=10, hidden_size=4) is None  # a prefill without MTP
    assert wire_draft(good, vocab_size=7, hidden_size=4) is None  # token outside the vocabulary
    assert wire_draft(good, vocab_size=10, hidden_size=5) is None  # another model's hidden size
    assert wire_draft(pb.TransferDone(mtp_draft_token_id=1, mtp_hidden=[float("nan")] * 4), 10, 4) is None


def test_abort_mid_speculative_decode_ends_once_and_frees_pages(setup):
    path, oracle, trained, prompts, _ = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)

    async def run():
        engine = DecodeEngine(_spec_runner(path, trained), worker_config("fake"), tokenizer=oracle.tokenizer)
        await engine.start()
        try:
            outcome, _ = await abort_after_first_event(engine, GenerateRequest("long", tuple(prompts[0]), params),
                                                       timeout_s=30)
            await pages_back(engine, timeout_s=2)
            assert not engine.speculation.decoder._drafts  # its draft state went with it
            return outcome
        finally:
            await engine.stop()

    outcome = asyncio.run(run())
    assert isinstance(outcome.terminal, Failed) and outcome.terminal.code.value == "aborted"
    assert 1 <= len(outcome.tokens) < 400


@pytest.mark.parametrize("expensive", [False, True])
def test_adaptive_draft_count_follows_the_costs(setup, expensive):
    """`speculative_adaptive`: step costs measured at start-up; then a table where drafting never
    pays gives no drafts at all, a flat one drafts; the output is the oracle's either way."""
    path, oracle, trained, prompts, _ = setup
    expected = oracle.generate_batch(prompts, GREEDY)
    runner = ModelRunner(RunnerConfig(model=path, page_size=PAGE_SIZE, num_pages=256, speculative_num_steps=3,
                                      speculative_adaptive=True))
    runner.model.mtp.load_state_dict(trained.model.mtp.state_dict())

    def set_costs(engine: DecodeEngine) -> None:
        measured = engine.speculation.policy.costs
        assert measured.max_steps == 3 and measured.batches[0] == 1
        growth = 100.0 if expensive else 1.0
        engine.speculation.policy = SpeculationPolicy(  # no probe: "never" means never here
            StepCosts((1, 64), tuple((10.0 * growth ** k, 20.0 * growth ** k) for k in range(4))), 3, probe_every=0)

    requests = [GenerateRequest(f"a{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]
    outcomes, stats = _colocated(runner, oracle, requests, prepare=set_costs)
    for outcome, want in zip(outcomes, expected):
        assert outcome.ok and outcome.tokens == want.output_ids
    assert (stats.drafted == 0) == expensive


def test_pd_with_tbo_on_both_sides_equals_offline(setup):
    """Two-batch overlap in both single-rank workers: the prefill's extend-with-MTP rounds and
    decode's verify extends run as two micro-batches; the tokens are the offline engine's."""
    path, oracle, trained, prompts, _ = setup
    expected = oracle.generate_batch(prompts, GREEDY)
    prefill_runner, decode_runner = (_spec_runner(path, trained, enable_tbo=True) for _ in range(2))
    outcomes, stats = _pd(prefill_runner, decode_runner, oracle, prompts, "grpc")
    for (p_out, d_out), want in zip(outcomes, expected):
        assert p_out.ok and d_out.ok, (p_out.terminal, d_out.terminal)
        assert d_out.tokens == want.output_ids
    assert decode_runner.model.tbo.stats["overlapped"] > 0 and prefill_runner.model.tbo.stats["overlapped"] > 0
    print(f"PD + TBO accept length {stats.accept_length:.2f}, decode TBO {decode_runner.model.tbo.stats}")
    assert stats.accept_length > 1.8


def test_stops_mid_acceptance_in_the_worker_as_without_speculation(setup):
    """A stop token or string that falls inside a step's accepted tokens ends the request there, as
    without speculation: the same tokens, logprobs, finish reason, matched stop and token count
    (the worker drops the step's tokens after the stop on the host), and the pool ends empty."""
    path, oracle, trained, prompts, rng = setup
    reference = oracle.generate_batch(prompts, GREEDY)
    params = []
    for r in reference:  # the trained prompts accept most drafts, so a stop lands inside a step
        cut = rng.randint(1, len(r.output_ids) - 2)
        if rng.random() < 0.5 or len(r.text) < 4:
            params.append(dataclasses.replace(GREEDY, stop_token_ids=(r.output_ids[cut],)))
        else:
            params.append(dataclasses.replace(GREEDY, stop=(r.text[len(r.text) // 2:][:2],)))
    expected = oracle.generate_batch(prompts, params)

    requests = [GenerateRequest(f"s{i}", tuple(p), sp, return_logprob=True)
                for i, (p, sp) in enumerate(zip(prompts, params))]
    outcomes, stats = _colocated(_spec_runner(path, trained), oracle, requests)
    for outcome, want in zip(outcomes, expected):
        assert outcome.ok and outcome.tokens == want.output_ids
        assert (outcome.terminal.reason, outcome.terminal.matched_stop) == (want.finish_reason, want.matched_stop)
        assert outcome.terminal.completion_tokens == len(want.output_ids)
        assert len(outcome.logprobs) == len(want.output_logprobs)
        assert all(abs(a - b) < 1e-4 for a, b in zip(outcome.logprobs, want.output_logprobs))
    assert stats.accepted > 0
