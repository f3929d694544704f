"""Grammars: compiled once per schema, clear errors, and requests that follow them on a tiny
model with SmolLM2's tokenizer (with speculation and with async scheduling too)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.structured.batch_mask import fill_token_bitmask
from kvbatch.engine.structured.grammar import GrammarCompiler
from kvbatch.engine.structured.params import StructuredOutputs

# Every string, array and number bounded: a random model must still end within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "pet": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}},
            "required": ["name"],
        },
    },
    "required": ["kind", "legs", "pet", "tags", "owner"],
}


@pytest.fixture(scope="module")
def compiler(smollm2_dir) -> GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])


def test_structured_outputs_validation() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(json_schema={"type": "object"}, json_object=True)
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json_schema="{type: object")
    with pytest.raises(ValueError, match="must be a JSON object"):
        StructuredOutputs(json_schema=[1, 2])
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"type": "object"})
    # the same schema as a dict or as text with other spacing: one key
    a = StructuredOutputs(json_schema={"type": "object", "required": []})
    b = StructuredOutputs(json_schema='{ "type" : "object",  "required": [] }')
    assert a.key == b.key and a.key != StructuredOutputs(json_object=True).key
    assert SamplingParams(structured_outputs=a).processes_logits


def test_compiled_once_per_distinct_schema(compiler) -> None:
    before = compiler.num_compiled
    first = compiler.compile(StructuredOutputs(json_schema=SCHEMA))
    assert compiler.compile(StructuredOutputs(json_schema=json.dumps(SCHEMA))) is first
    compiler.compile(StructuredOutputs(json_object=True))
    compiler.compile(StructuredOutputs(json_object=True))
    assert compiler.num_compiled == before + 2


def test_uncompilable_schema_is_a_clear_error(compiler) -> None:
    with pytest.raises(ValueError, match="cannot be compiled into a grammar"):
        compiler.compile(StructuredOutputs(json_schema={"$ref": "#/$defs/missing"}))


def test_matcher_masks_and_advances(compiler, smollm2_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = '{"kind": "dog", "legs": 4, "pet": true, "tags": ["a"], "owner": {"name": "Bo"}}'
    ids = tokenizer.encode(text)
    spec = StructuredOutputs(json_schema=SCHEMA)
    m = compiler.matcher(spec)
    for token in ids:
        mask = fill_token_bitmask([None, m], 49152, torch.device("cpu"))
        assert mask.rows.tolist() == [1]
        word = int(mask.words[0, token // 32]) & 0xFFFFFFFF
        assert (word >> (token % 32)) & 1, tokenizer.decode([token])
        assert m.accept(token)
    assert not m.is_terminated()
    assert m.accept(tokenizer.eos_token_id) and m.is_terminated()
    # a token the grammar forbids is refused and changes nothing
    fresh = compiler.matcher(spec)
    assert not fresh.accept(tokenizer.encode("hello")[0])
    assert fresh.accept(ids[0])


def test_no_raw_control_characters_in_bounded_strings(compiler, smollm2_dir) -> None:
    """xgrammar's rule for a string with maxLength admits bytes 0x00-0x1f, which JSON
    forbids unescaped: the compiler's allowed-token mask takes them out."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    m = compiler.matcher(StructuredOutputs(json_schema=SCHEMA))
    for token in tokenizer.encode(
        '{"kind": "dog", "legs": 4, "pet": true, "tags": [], "owner": {"name": "'
    ):
        assert m.accept(token)
    words = torch.empty((1, 1536), dtype=torch.int32)
    m.fill_bitmask(words, 0)
    bits = [(int(words[0, t // 32]) >> (t % 32)) & 1 for t in range(49152)]
    allowed = [t for t, bit in enumerate(bits) if bit]
    assert len(allowed) > 1000  # most of the vocabulary may go in a string
    assert not [t for t in allowed if any(ord(c) < 0x20 for c in tokenizer.decode([t]))]
    tab = tokenizer.convert_tokens_to_ids("ĉ")  # byte-level "\t"
    assert tokenizer.decode([tab]) == "\t" and not bits[tab]


def test_batch_fill_equals_row_by_row(compiler, smollm2_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer.encode('{"kind": "cat", "legs": 4, "pet": false, "tags": ["b"], "owner": {')
    matchers = []
    for i in range(9):
        m = compiler.matcher(StructuredOutputs(json_schema=SCHEMA if i % 3 else {"type": "object"}))
        for token in ids[: 2 * i] if i % 3 else []:
            assert m.accept(token)
        matchers.append(m)
    mask = fill_token_bitmask([None, *matchers, None], 49152, torch.device("cpu"))
    assert mask.rows.tolist() == list(range(1, 10))
    one = torch.empty((9, 1536), dtype=torch.int32)
    for row, m in enumerate(matchers):
        m.fill_bitmask(one, row)
    assert torch.equal(mask.words, one)
    assert len({tuple(r.tolist()) for r in one}) > 3  # rows at different points differ


def test_fill_writes_the_whole_row(compiler) -> None:
    """The host tensor is not cleared first: the grammar must write every word of its row."""
    m = compiler.matcher(StructuredOutputs(json_schema=SCHEMA))
    rows = []
    for start in (0, -1, 0x55555555):
        words = torch.full((1, 1536), start, dtype=torch.int32)
        m.fill_bitmask(words, 0)
        rows.append(words)
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])


# ---------------------------------------------------------------- engine, tiny chat model


def constrained(i: int) -> SamplingParams:
    so = StructuredOutputs(json_schema=SCHEMA)
    if i % 2:
        return SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs=so)
    return SamplingParams(max_tokens=120, temperature=0, structured_outputs=so)


FREE = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5] * i + [9, 10, 11] for i in range(1, 7)]


def run(path, **engine_args) -> tuple[list, LLM]:
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=256, max_model_len=512, **engine_args)
    params = [constrained(i) for i in range(4)] + [FREE] * 2
    return llm.generate(PROMPTS, params, use_tqdm=False), llm


def check_valid(outs) -> None:
    for out in outs[:4]:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)


@pytest.fixture(scope="module")
def sync_run(tiny_chat_model):
    return run(tiny_chat_model)


def test_random_model_still_follows_the_schema(sync_run) -> None:
    outs, llm = sync_run
    check_valid(outs)
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize(
    "engine_args",
    [dict(speculative="ngram", num_speculative_tokens=3), dict(async_scheduling=True)],
    ids=["speculative", "async"],
)
def test_same_answers_with_speculation_or_async(tiny_chat_model, sync_run, engine_args) -> None:
    """Constrained requests do not speculate and pause step overlap; the free requests still
    speculate beside them; every answer is what the plain engine gives."""
    want, _ = sync_run
    outs, llm = run(tiny_chat_model, **engine_args)
    check_valid(outs)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    if "speculative" in engine_args:
        assert llm.stats().spec_draft_tokens > 0  # the free requests did speculate
        assert all(o.spec_stats is None for o in outs[:4])
    llm.engine.kv.check_integrity()


def test_bad_schema_fails_at_add_request(tiny_chat_model) -> None:
    llm = LLM(model=str(tiny_chat_model), device="cpu", num_kv_blocks=64, max_model_len=256)
    bad = SamplingParams(structured_outputs=StructuredOutputs(json_schema={"$ref": "#/nope"}))
    with pytest.raises(ValueError, match="cannot be compiled"):
        llm.engine.add_request([1, 2, 3], bad)
    assert not llm.engine.has_unfinished()
    [out] = llm.generate([[1, 2, 3]], bad, use_tqdm=False)
    assert out.error and "cannot be compiled" in out.error


def test_choices_each_follow_the_schema(tiny_chat_model) -> None:
    llm = LLM(model=str(tiny_chat_model), device="cpu", num_kv_blocks=128, max_model_len=256)
    params = SamplingParams(
        n=3, max_tokens=120, seed=4, structured_outputs=StructuredOutputs(json_schema=SCHEMA)
    )
    [out] = llm.generate([PROMPTS[2]], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    llm.engine.kv.check_integrity()


def test_params_import_without_torch() -> None:
    """The jobs layer validates request bodies into SamplingParams without loading torch."""
    code = (
        "import sys\n"
        "from kvbatch.engine import SamplingParams, StructuredOutputs\n"
        "SamplingParams(n=2, logit_bias={'5': 1}, structured_outputs="
        "StructuredOutputs(json_schema={'type': 'object'}))\n"
        "assert 'torch' not in sys.modules and 'xgrammar' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
