"""DecodeEngine on real tiny HF decoders: continuous batching equals per-request generate."""
import copy
import random

import pytest
import torch

from tests.models.text_lm import TextLMSpec, build_text_lm, greedy_ignore_eos, payload_for

from easerve.engine.attention import ATTN_IMPL
from easerve.engine.config import EngineConfig
from easerve.engine.engine import DecodeEngine
from easerve.errors import Overloaded, RequestTooLarge
from easerve.types import SamplingParams
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface

torch.set_num_threads(1)
GREEDY = SamplingParams


@pytest.fixture(scope="module")
def llama():
    return build_text_lm(TextLMSpec(family="llama"))


def _reference(adapter):
    """A copy of the model that keeps plain sdpa attention (the engine switches the original)."""
    return copy.deepcopy(adapter)


def _generate(ref, ids: list[int], max_new: int) -> list[int]:
    """The unsplit model's own greedy generate (Llama/Qwen2 *ForCausalLM.generate)."""
    out = ref.causal_lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        do_sample=False, max_new_tokens=max_new, pad_token_id=0, eos_token_id=2)
    return out[0, len(ids):].tolist()


def _drive(engine, arrivals: dict[int, list], max_steps: int = 500) -> dict[str, list]:
    """Add payloads at their step, step until idle; collect each request's outputs."""
    outs: dict[str, list] = {}
    for step in range(max_steps):
        for p in arrivals.get(step, []):
            engine.add(p)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if not engine.has_work and step >= max(arrivals, default=0):
            return outs
    raise AssertionError("engine did not finish")


def _tokens(outs):
    return {rid: [o.token_id for o in os_ if o.token_id is not None] for rid, os_ in outs.items()}


@pytest.mark.parametrize("family,kv", [
    ("llama", dict(kv_capacity_tokens=640, block_size=16)),   # paged; tight enough that some wait
    ("qwen2", dict(num_slots=6, max_seq_len=64)),             # slots; max_running 8 > 6 slots
])
def test_continuous_batching_equals_generate(family, kv):
    adapter = build_text_lm(TextLMSpec(family=family, seed=1))
    ref = _reference(adapter)
    engine = DecodeEngine(adapter, EngineConfig(max_running=8, max_waiting=16, **kv))
    rng = random.Random(0)
    reqs = {f"r{i}": ([rng.randrange(3, 320) for _ in range(rng.randrange(2, 40))], rng.randrange(1, 22))
            for i in range(16)}
    arrivals: dict[int, list] = {}
    for rid, (ids, n) in reqs.items():
        arrivals.setdefault(rng.randrange(0, 12), []).append(payload_for(adapter, rid, ids, GREEDY(max_tokens=n)))
    got = _tokens(_drive(engine, arrivals))
    for rid, (ids, n) in reqs.items():
        assert got[rid] == _generate(ref, ids, n), rid
    assert engine.stats().kv_free_tokens == engine.stats().kv_capacity_tokens


def test_finish_reasons_and_indices(llama):
    engine = DecodeEngine(llama, EngineConfig(max_running=4, kv_capacity_tokens=256))
    outs = _drive(engine, {0: [payload_for(llama, "a", [5, 6, 7], GREEDY(max_tokens=4, ignore_eos=True)),
                               payload_for(llama, "b", [9, 8], GREEDY(max_tokens=1))]})
    assert [o.index for o in outs["a"]] == [0, 1, 2, 3]
    assert [o.finished for o in outs["a"]] == [False, False, False, True]
    assert outs["a"][-1].finish_reason == "length" and outs["b"][0].finish_reason == "length"


def test_seeded_sampling_is_independent_of_the_batch(llama):
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=40, seed=7, ignore_eos=True)
    ids = [11, 12, 13, 14, 15]

    def run(neighbours: int) -> list[int]:
        engine = DecodeEngine(llama, EngineConfig(max_running=16, kv_capacity_tokens=1024))
        rng = random.Random(neighbours)
        others = [payload_for(llama, f"n{i}", [rng.randrange(3, 320) for _ in range(rng.randrange(2, 30))],
                              SamplingParams(max_tokens=rng.randrange(1, 15), temperature=rng.choice([0, 0.8]),
                                             seed=rng.choice([None, i])))
                  for i in range(neighbours)]
        arrivals = {0: others[: neighbours // 2], 1: [payload_for(llama, "me", ids, sp)], 3: others[neighbours // 2:]}
        return _tokens(_drive(engine, arrivals))["me"]

    alone = run(0)
    assert run(5) == alone and run(11) == alone
    assert len(set(alone)) > 3  # really sampled


def test_admission_waits_for_kv_and_proceeds_when_room_frees(llama):
    ref = _reference(llama)
    # 3 slots of 32 tokens; every request reserves one slot
    engine = DecodeEngine(llama, EngineConfig(max_running=8, max_waiting=8, num_slots=3, max_seq_len=32))
    reqs = {f"q{i}": ([20 + i, 30 + i, 40 + i], 4 + 3 * i) for i in range(5)}
    for rid, (ids, n) in reqs.items():
        engine.add(payload_for(llama, rid, ids, GREEDY(max_tokens=n, ignore_eos=True)))
    outs = {rid: [] for rid in reqs}
    admitted_at = {}
    for step in range(100):
        for o in engine.step():
            outs[o.request_id].append(o.token_id)
            admitted_at.setdefault(o.request_id, step) if o.index == 1 else None
        s = engine.stats()
        assert s.running <= 3 and s.running + s.waiting + sum(len(v) == reqs[k][1] for k, v in outs.items()) == 5
        if step == 0:
            assert (s.running, s.waiting, s.kv_free_tokens) == (3, 2, 0)
        if not engine.has_work:
            break
    # q3 / q4 start only after q0 (4 tokens, 3 steps) and q1 (7 tokens) leave
    assert admitted_at == {"q0": 0, "q1": 0, "q2": 0, "q3": 3, "q4": 6}
    assert outs == {rid: greedy_ignore_eos(ref, ids, n) for rid, (ids, n) in reqs.items()}


def test_abort_frees_kv_at_once(llama):
    engine = DecodeEngine(llama, EngineConfig(max_running=4, kv_capacity_tokens=256, block_size=16))
    for rid in ("keep", "drop"):
        engine.add(payload_for(llama, rid, [3, 4, 5, 6], GREEDY(max_tokens=40, ignore_eos=True)))
    engine.step()
    engine.step()
    before = engine.stats()
    assert before.running == 2 and before.kv_reserved_tokens == 2 * 48
    assert engine.abort("drop") and not engine.abort("drop") and not engine.abort("unknown")
    after = engine.stats()
    assert after.running == 1 and after.kv_free_tokens == before.kv_free_tokens + 48
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("drop", "abort")]
    assert all(o.request_id == "keep" for o in engine.step())


def test_overloaded_when_waiting_queue_is_full(llama):
    engine = DecodeEngine(llama, EngineConfig(max_running=1, max_waiting=2, kv_capacity_tokens=256))
    for rid in ("a", "b"):
        engine.add(payload_for(llama, rid, [3, 4], GREEDY(max_tokens=5)))
    with pytest.raises(Overloaded):
        engine.add(payload_for(llama, "c", [3, 4], GREEDY(max_tokens=5)))
    with pytest.raises(RequestTooLarge):
        engine.add(payload_for(llama, "d", [3, 4], GREEDY(max_tokens=1000)))
    engine.step()  # "a" admitted: room in the queue again
    engine.add(payload_for(llama, "c", [3, 4], GREEDY(max_tokens=5)))


def test_bad_payload_and_config_are_rejected(llama):
    assert EngineConfig(kv_capacity_tokens=16384).geometry() == (1024, 16, None)
    assert EngineConfig(kv_capacity_tokens=64, num_slots=2, max_seq_len=32).sizing == "kv_capacity_tokens"
    with pytest.raises(ValueError, match="--max-seq-len"):
        EngineConfig(num_slots=2).kv_geometry(1)   # the engine passes the model's context as model_len
    engine = DecodeEngine(llama, EngineConfig(kv_capacity_tokens=64))
    p = payload_for(llama, "x", [3, 4, 5], GREEDY())
    p.keys = p.keys[:1]
    with pytest.raises(ValueError, match="layers"):
        engine.add(p)


def test_stop_token_ids_and_stop_strings(llama):
    ref = _reference(llama)
    tok = llama.tokenizer
    ids = tok.encode("the quick brown")
    full = greedy_ignore_eos(ref, ids, 20)
    engine = DecodeEngine(llama, EngineConfig(max_running=4, kv_capacity_tokens=512))
    # stop id: the 5th generated token (first occurrence wins)
    stop_id = full[4]
    cut = full.index(stop_id) + 1
    outs = _drive(engine, {0: [payload_for(llama, "ids", ids, GREEDY(max_tokens=20, ignore_eos=True,
                                                                  stop_token_ids=(stop_id,)))]})
    assert [o.token_id for o in outs["ids"]] == full[:cut] and outs["ids"][-1].finish_reason == "stop"
    # stop string: two characters spanning the boundary between two text deltas (so two tokens)
    outs = _drive(engine, {0: [payload_for(llama, "all", ids, GREEDY(max_tokens=20, ignore_eos=True))]})
    deltas = [o.text_delta for o in outs["all"]]
    text = "".join(deltas)
    assert text == tok.decode(full)
    ends = [len("".join(deltas[:j])) for j in range(1, len(deltas)) if deltas[j - 1] and deltas[j]]
    b = next(e for e in ends[2:] if "\ufffd" not in text[e - 1:e + 1])
    stop = text[b - 1:b + 1]
    outs = _drive(engine, {0: [payload_for(llama, "str", ids, GREEDY(max_tokens=20, ignore_eos=True, stop=(stop,)))]})
    assert "".join(o.text_delta for o in outs["str"]) == text[:text.index(stop)]
    assert outs["str"][-1].finish_reason == "stop"
    assert [o.token_id for o in outs["str"]] == full[:len(outs["str"])] and len(outs["str"]) < 20


def test_eos_stops_unless_ignore_eos(llama, monkeypatch):
    ref = _reference(llama)
    ids = [7, 8, 9, 10]
    free_run = greedy_ignore_eos(ref, ids, 12)
    eos = free_run[5]
    monkeypatch.setattr(llama, "generation_eos", [2, eos])
    engine = DecodeEngine(llama, EngineConfig(kv_capacity_tokens=256))
    outs = _drive(engine, {0: [payload_for(llama, "eos", ids, GREEDY(max_tokens=12)),
                               payload_for(llama, "ign", ids, GREEDY(max_tokens=12, ignore_eos=True))]})
    expected = ref.causal_lm.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12,
                                      eos_token_id=[2, eos], pad_token_id=0)[0, len(ids):].tolist()
    assert [o.token_id for o in outs["eos"]] == expected == free_run[:free_run.index(eos) + 1]
    assert outs["eos"][-1].finish_reason == "stop"
    assert [o.token_id for o in outs["ign"]] == free_run and outs["ign"][-1].finish_reason == "length"


def test_prefill_on_the_switched_model_is_still_sdpa(llama):
    ref = _reference(llama)
    DecodeEngine(llama, EngineConfig(kv_capacity_tokens=64))
    assert llama.lm.config._attn_implementation == ATTN_IMPL
    x = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        a = llama.lm(input_ids=x, attention_mask=mask).last_hidden_state
        b = ref.lm(input_ids=x, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1, 2:], b[1, 2:])


def test_decode_step_skips_hf_mask_creation(llama, monkeypatch):
    made = []
    engine = DecodeEngine(llama, EngineConfig(kv_capacity_tokens=128))
    real = AttentionMaskInterface._global_mapping[ATTN_IMPL]
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, ATTN_IMPL,
                        lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    engine.add(payload_for(llama, "a", [3, 4, 5], GREEDY(max_tokens=3, ignore_eos=True)))
    engine.add(payload_for(llama, "b", [3, 4, 5, 6, 7, 8], GREEDY(max_tokens=3, ignore_eos=True)))
    while engine.has_work:
        engine.step()
    assert made and all(m is None for m in made)


def test_mrope_3d_positions_with_rope_deltas():
    """Qwen2.5-VL text decoder: prompts whose middle is laid out like an image grid (3-D
    positions, rope_delta < 0) decode in one batch exactly like a per-request HF loop."""
    adapter = build_text_lm(TextLMSpec(family="qwen2_5_vl", seed=2))
    ref = _reference(adapter)
    engine = DecodeEngine(adapter, EngineConfig(max_running=4, kv_capacity_tokens=512))
    cases = {"p0": (3, 2, 3, 4, 10), "p1": (5, 3, 3, 2, 7), "p2": (2, 1, 1, 6, 12)}  # text, h, w, text, new
    expected, arrivals = {}, {}
    for i, (rid, (a, h, w, c, n)) in enumerate(cases.items()):
        ids = [40 + (7 * j + i) % 250 for j in range(a + h * w + c)]
        pos = _grid_positions(a, h, w, c)
        expected[rid] = _mrope_greedy(ref, ids, pos, n)
        arrivals.setdefault(i, []).append(payload_for(adapter, rid, ids, GREEDY(max_tokens=n, ignore_eos=True), pos))
        assert arrivals[i][-1].rope_delta == int(pos.max()) + 1 - len(ids) < 0 or h * w == 1
    assert _tokens(_drive(engine, arrivals)) == expected


def _grid_positions(a: int, h: int, w: int, c: int) -> torch.Tensor:
    """[3, 1, T]: a text tokens, an h x w grid (t fixed, h/w vary), c text tokens after it."""
    t = torch.arange(a)
    rows = [torch.stack([t, t, t])]
    grid = torch.stack([torch.full((h * w,), a), a + torch.arange(h).repeat_interleave(w), a + torch.arange(w).repeat(h)])
    rows.append(grid)
    start = int(grid.max()) + 1
    tail = torch.arange(start, start + c)
    rows.append(torch.stack([tail, tail, tail]))
    return torch.cat(rows, dim=1)[:, None, :]


def _mrope_greedy(ref, ids, pos, n):
    cache, toks = DynamicCache(config=ref.text_config), []
    nxt = int(pos.max()) + 1
    with torch.no_grad():
        h = ref.lm(input_ids=torch.tensor([ids]), position_ids=pos, cache=cache, use_cache=True).last_hidden_state
        for k in range(n):
            toks.append(int(ref.lm_head(h[0, -1]).argmax()))
            p = torch.full((3, 1, 1), nxt + k)
            h = ref.lm(input_ids=torch.tensor([[toks[-1]]]), position_ids=p, cache=cache, use_cache=True).last_hidden_state
    return toks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_continuous_batching_on_cuda():
    adapter = build_text_lm(TextLMSpec(family="llama", seed=3), device="cuda")
    ref = _reference(adapter)
    engine = DecodeEngine(adapter, EngineConfig(max_running=16, kv_capacity_tokens=1024, block_size=16, device="cuda"))
    rng = random.Random(1)
    reqs = {f"g{i}": ([rng.randrange(3, 320) for _ in range(rng.randrange(2, 40))], rng.randrange(1, 20))
            for i in range(16)}
    arrivals = {i % 6: [] for i in range(6)}
    for i, (rid, (ids, n)) in enumerate(reqs.items()):
        arrivals[i % 6].append(payload_for(adapter, rid, ids, GREEDY(max_tokens=n, ignore_eos=True)))
    got = _tokens(_drive(engine, arrivals))
    for rid, (ids, n) in reqs.items():
        assert got[rid] == greedy_ignore_eos(ref, ids, n), rid


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transposed_linear_layouts_decode_the_same_tokens(family, monkeypatch):
    """Every LM linear (and the lm_head) stored transposed (cpu_gemv forced) decodes what
    the loaded layout decodes, and what the model's own generate does."""
    from easerve.engine import cpu_gemv
    monkeypatch.setattr(cpu_gemv, "MIN_GAIN", 0.0)  # every shape "measures" faster transposed
    monkeypatch.setattr(cpu_gemv, "_measured", {})
    adapter = build_text_lm(TextLMSpec(family=family, seed=3))
    ref, plain_copy = _reference(adapter), copy.deepcopy(adapter)
    moved = DecodeEngine(adapter, EngineConfig(max_running=4, kv_capacity_tokens=512, block_size=16))
    kept = DecodeEngine(plain_copy, EngineConfig(max_running=4, kv_capacity_tokens=512, block_size=16,
                                                 linear_layout="torch"))
    assert moved.linear_layouts and all(moved.linear_layouts.values()) and kept.linear_layouts == {}
    swapped = [m for m in adapter.language_model.modules() if isinstance(m, cpu_gemv.TransposedLinear)]
    assert swapped and not any(isinstance(m, torch.nn.Linear) for m in adapter.language_model.modules())
    assert not any(isinstance(m, cpu_gemv.TransposedLinear) for m in plain_copy.language_model.modules())
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    sp = GREEDY(max_tokens=12, ignore_eos=True)
    got = {}
    for name, engine, model in (("moved", moved, adapter), ("kept", kept, plain_copy)):
        got[name] = _tokens(_drive(engine, {0: [payload_for(model, f"r{i}", ids, sp)
                                               for i, ids in enumerate(prompts)]}))
    assert got["moved"] == got["kept"]
    for i, ids in enumerate(prompts):
        assert got["moved"][f"r{i}"] == greedy_ignore_eos(ref, ids, 12)
