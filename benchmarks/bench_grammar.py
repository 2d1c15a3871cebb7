"""Structured-generation libraries side by side: llguidance (what llm.grammar uses) and xgrammar.

For both real vocabularies (SmolLM2 49,152 tokens, BPE; Gemma 3 262,144 tokens, SPM) and a
JSON schema and two GBNF grammars, it steps through a valid output token by token and times
the per-token mask (median over the tokens); it also times applying the mask to a logits row
on the host (numpy) and on the JAX device (bitmask sent, jnp.where, row fetched back), checks
GBNF coverage on tests/data/grammar/gbnf_cases.json (grammars that compile and accept/reject
as they must, invalid grammars refused) and on llama.cpp's grammars/*.gbnf when --gbnf-dir
points at a checkout, and reports install weight (package plus dependencies on disk) and
import time. xgrammar is skipped when it is not installed.

    python benchmarks/bench_grammar.py [--models smollm2-135m gemma3-270m] [--gbnf-dir DIR]
                                       [--generate smollm2-135m ...] [--runs 5]
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llm import hub, load_model  # noqa: E402
from llm.sampling import structured as G  # noqa: E402

CASES = json.loads((ROOT / "tests" / "data" / "grammar" / "gbnf_cases.json").read_text())
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
SCHEMA_TEXT = ('{"name": "Alice", "age": 34, "role": "admin", "address": {"city": "Lisbon", "zip": "1000-001"}, '
               '"tags": ["engineering", "on-call", "mentor"]}')
JSON_GBNF = next(c["grammar"] for c in CASES["cases"] if c["name"] == "json-like")
JSON_GBNF_TEXT = '{"title": "Notes on grammars", "pages": 12, "draft": true, "meta": {"lang": "en", "score": -1.5}}'
TEXT_GBNF = 'root ::= sentence+\nsentence ::= [A-Z] [a-z ,]* [.!?] " "?'
TEXT_GBNF_TEXT = ("The quick brown fox jumps over the lazy dog. "
                  "Grammars constrain what a model may say, token by token. ")
WORKLOADS = [("json-schema", "schema", SCHEMA, SCHEMA_TEXT), ("gbnf-json", "gbnf", JSON_GBNF, JSON_GBNF_TEXT),
             ("gbnf-text", "gbnf", TEXT_GBNF, TEXT_GBNF_TEXT)]


# --- install weight ------------------------------------------------------------------------------


def _requirements(dist: str) -> list[str]:
    out = []
    for req in md.requires(dist) or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]
        out.append(name)
    return out


def install_weight(dist: str) -> tuple[float, list[str]]:
    """MB on disk of the distribution and everything it requires (transitively)."""
    seen, todo, total = set(), [dist], 0
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for f in d.files or []:
            p = Path(d.locate_file(f))
            if p.is_file():
                total += p.stat().st_size
        todo += _requirements(name)
    return total / 2**20, sorted(seen - {dist})


def import_seconds(module: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, capture_output=True)
    return time.perf_counter() - t0


# --- the libraries ---------------------------------------------------------------------------------


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab, gvocab: G.GrammarVocab):
        self.gvocab = gvocab
        self.n_vocab = vocab.n_tokens

    def compile(self, kind, src):
        spec = G.spec_json_schema(src) if kind == "schema" else G.spec_gbnf(src)
        return spec.sampler(self.gvocab)

    def mask(self, g) -> np.ndarray:
        g.matcher.unsafe_compute_mask_ptr(g.bitmask.ctypes.data, g.bitmask.nbytes)
        return g.bitmask

    def consume(self, g, token) -> bool:
        return g.matcher.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab, gvocab: G.GrammarVocab):
        import xgrammar as xg

        self.xg = xg
        pieces = [p if not p.startswith(b"\xff") else b"" for p in gvocab.pieces]
        info = xg.TokenizerInfo(pieces, xg.VocabType.RAW, vocab_size=vocab.n_tokens, stop_token_ids=gvocab.eog)
        self.compiler = xg.GrammarCompiler(info)
        self.n_vocab = vocab.n_tokens

    def compile(self, kind, src):
        if kind == "schema":
            cg = self.compiler.compile_json_schema(json.dumps(src), any_whitespace=False, separators=(", ", ": "))
        else:
            cg = self.compiler.compile_grammar(src)
        m = self.xg.GrammarMatcher(cg)
        m.bitmask = self.xg.allocate_token_bitmask(1, self.n_vocab)
        return m

    def mask(self, m):
        m.fill_next_token_bitmask(m.bitmask)
        return m.bitmask

    def consume(self, m, token) -> bool:
        return m.accept_token(token)


def time_masks(lib, kind, src, tokens) -> tuple[float, float, int]:
    """(compile seconds, median per-token mask seconds, tokens consumed)."""
    t0 = time.perf_counter()
    g = lib.compile(kind, src)
    t_compile = time.perf_counter() - t0
    times = []
    for tok in tokens:
        t0 = time.perf_counter()
        lib.mask(g)
        times.append(time.perf_counter() - t0)
        if not lib.consume(g, tok):
            break
    return t_compile, float(np.median(times)), len(times)


# --- applying a mask: host vs device -----------------------------------------------------------------


def apply_times(n_vocab: int, density: float, reps: int = 200) -> dict:
    """Median seconds to apply a bitmask with `density` allowed tokens to one logits row."""
    import jax
    import jax.numpy as jnp

    from llm.sampling.samplers import TokenDataArray

    rng = np.random.default_rng(0)
    logits = rng.standard_normal(n_vocab).astype(np.float32)
    allowed = rng.random(n_vocab) < density
    bitmask = np.packbits(allowed, bitorder="little")
    bitmask = np.pad(bitmask, (0, (-bitmask.size) % 4)).view(np.int32)

    class Fixed(G.Grammar):
        """The sampler's host path with a fixed mask (no grammar engine in the timing)."""

        def __init__(self):
            self.n_vocab = n_vocab

        def allowed(self):
            return G.unpack_bitmask(bitmask, n_vocab)

    sampler = Fixed()

    def host():
        cur = TokenDataArray.from_logits(logits)
        sampler.apply(cur)
        return cur.logits

    @jax.jit
    def on_device(row, bits):
        words = bits.view(jnp.uint32)
        ids = jnp.arange(n_vocab)
        bit = (words[ids // 32] >> (ids % 32).astype(jnp.uint32)) & 1
        return jnp.where(bit == 1, row, -jnp.inf)

    dev_logits = jax.device_put(logits)
    out = {}
    for name, fn in (("host numpy (the Grammar sampler)", host),
                     ("device jnp (bitmask up, row down)",
                      lambda: np.asarray(on_device(dev_logits, jax.device_put(bitmask))))):
        np.testing.assert_array_equal(fn(), np.where(allowed, logits, -np.inf))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = float(np.median(ts))
    out["device"] = str(jax.devices()[0])
    return out


# --- GBNF coverage ------------------------------------------------------------------------------------


def coverage_llguidance(byte_tok) -> tuple[int, int, int]:
    import llguidance

    ok = 0
    for c in CASES["cases"]:
        try:
            spec = G.spec_gbnf(c["grammar"], c.get("root", "root"))
        except Exception:
            continue
        good = True
        for text, want in [(t, True) for t in c["accept"]] + [(t, False) for t in c["reject"]]:
            m = llguidance.LLMatcher(byte_tok, spec.grammar, log_level=0)
            got = all(m.consume_token(b) for b in text.encode()) and m.is_accepting()
            good &= got == want
        ok += good
    refused = 0
    for c in CASES["invalid"]:
        try:
            G.spec_gbnf(c["grammar"])
        except Exception:
            refused += 1
    return ok, len(CASES["cases"]), refused


def coverage_xgrammar() -> tuple[int, int, int]:
    import xgrammar as xg

    info = xg.TokenizerInfo([bytes([b]) for b in range(256)] + [b""], xg.VocabType.RAW, stop_token_ids=[256])
    compiler = xg.GrammarCompiler(info)
    ok = 0
    for c in CASES["cases"]:
        try:
            cg = compiler.compile_grammar(xg.Grammar.from_ebnf(c["grammar"], root_rule_name=c.get("root", "root")))
        except Exception:
            continue
        good = True
        for text, want in [(t, True) for t in c["accept"]] + [(t, False) for t in c["reject"]]:
            m = xg.GrammarMatcher(cg, terminate_without_stop_token=True)
            got = all(m.accept_token(b) for b in text.encode()) and m.is_completed()
            good &= got == want
        ok += good
    refused = 0
    for c in CASES["invalid"]:
        try:
            compiler.compile_grammar(xg.Grammar.from_ebnf(c["grammar"]))
        except Exception:
            refused += 1
    return ok, len(CASES["cases"]), refused


def coverage_dir(directory: Path, have_xgrammar: bool) -> list[tuple[str, str, str]]:
    rows = []
    for f in sorted(directory.glob("*.gbnf")):
        src = f.read_text()
        try:
            G.spec_gbnf(src)
            a = "ok"
        except Exception as e:
            a = f"error: {str(e)[:50]}"
        b = "-"
        if have_xgrammar:
            import xgrammar as xg
            try:
                xg.Grammar.from_ebnf(src)
                b = "ok"
            except Exception as e:
                b = f"error: {str(e)[:50]}"
        rows.append((f.name, a, b))
    return rows


def byte_tokenizer():
    import llguidance

    class Bytes:
        tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]

        def __call__(self, text):
            return list(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()), n_vocab=257, eos_token=256)


def generation_speed(name: str, runs: int) -> None:
    """Decode tok/s of the same chat request without and with the JSON schema, interleaved, and the
    sampler chain's own time per token (SamplerChain.perf), which is what the constraint adds: on
    a shared machine tok/s swings more between runs than the chain costs."""
    import llm

    m = llm.LLM(name, n_ctx=1024)
    chains: list = []
    make_chain = m._sampler

    def recording_sampler(*args, **kw):
        chains.append(make_chain(*args, **kw))
        return chains[-1]

    m._sampler = recording_sampler
    msgs = [{"role": "user", "content": "Write a long JSON description of a fictional employee: name, code, "
                                        "age, role, address with city and zip, and several tags."}]
    tokens = m.chat_tokens(msgs)
    m.generate(tokens, max_tokens=4, json_schema=SCHEMA)       # compile, build the grammar vocabulary
    kinds = ("unconstrained", "json-schema")
    speed: dict[str, list[float]] = {k: [] for k in kinds}
    sample_ms: dict[str, list[float]] = {k: [] for k in kinds}
    step_ms: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(runs):
        for kind in kinds:
            kw = {"json_schema": SCHEMA} if kind == "json-schema" else {}
            c = m.generate(tokens, max_tokens=64, temperature=0.8, seed=r, **kw)
            perf = chains[-1].perf()
            speed[kind].append(c.timings["gen_tok_s"])
            sample_ms[kind].append(perf["t_sample_ms"] / max(perf["n_sample"], 1))
            step_ms[kind].append(c.timings["gen_s"] * 1e3 / max(c.n_completion_tokens, 1))
    base = float(np.median(speed["unconstrained"]))
    for kind in kinds:
        med = float(np.median(speed[kind]))
        print(f"{name:14} {kind:14} {med:8.1f} tok/s ({med / base - 1:+6.1%})  sampler chain "
              f"{np.median(sample_ms[kind]):6.3f} ms/token of {np.median(step_ms[kind]):7.1f} ms/token")
    extra = float(np.median(sample_ms["json-schema"]) - np.median(sample_ms["unconstrained"]))
    step = float(np.median(step_ms["unconstrained"]))
    print(f"{name:14} the constraint adds {extra:.3f} ms per token: {extra / step:.1%} of an unconstrained step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--gbnf-dir", type=Path, help="llama.cpp's grammars/ folder, for the coverage table")
    ap.add_argument("--generate", nargs="*", default=["smollm2-135m"], metavar="MODEL",
                    help="models for the constrained vs unconstrained tok/s table (none: skip it)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    try:
        import xgrammar  # noqa: F401
        have_xg = True
    except ImportError:
        have_xg = False
    libs = [LLGuidance] + ([XGrammar] if have_xg else [])

    print("## install weight (package + dependencies on disk) and import time")
    print(f"{'library':12} {'MB':>8} {'import s':>9}  dependencies")
    for dist, module in (("llguidance", "llguidance"), ("xgrammar", "xgrammar")):
        try:
            mb, deps = install_weight(dist)
        except md.PackageNotFoundError:
            print(f"{dist:12} not installed")
            continue
        print(f"{dist:12} {mb:8.1f} {import_seconds(module):9.2f}  {', '.join(deps) or '-'}")

    print("\n## GBNF coverage (own cases: compile + every accept/reject right; invalid grammars refused)")
    tok = byte_tokenizer()
    print(f"{'library':12} {'cases ok':>10} {'invalid refused':>16}")
    ok, n, refused = coverage_llguidance(tok)
    print(f"{'llguidance':12} {ok:>5}/{n:<4} {refused:>11}/{len(CASES['invalid'])}")
    if have_xg:
        ok, n, refused = coverage_xgrammar()
        print(f"{'xgrammar':12} {ok:>5}/{n:<4} {refused:>11}/{len(CASES['invalid'])}")
    if args.gbnf_dir:
        print(f"\n## llama.cpp grammars in {args.gbnf_dir}")
        print(f"{'file':22} {'llguidance (llm.gbnf)':40} {'xgrammar':40}")
        for name, a, b in coverage_dir(args.gbnf_dir, have_xg):
            print(f"{name:22} {a:40} {b:40}")

    print("\n## per-token mask (median over a valid output), compile time")
    print(f"{'model':14} {'n_vocab':>8} {'workload':12} {'library':11} {'compile ms':>11} {'mask ms':>8} {'tokens':>7}")
    for name in args.models:
        vocab = load_model(hub.pull(name), vocab_only=True).vocab
        t0 = time.perf_counter()
        gvocab = G.GrammarVocab(vocab)
        t_vocab = time.perf_counter() - t0
        for lib_cls in libs:
            t0 = time.perf_counter()
            lib = lib_cls(vocab, gvocab)
            t_lib = time.perf_counter() - t0
            print(f"{name:14} {vocab.n_tokens:8} {'(vocab)':12} {lib.name:11} "
                  f"{(t_vocab + t_lib if lib.name == 'llguidance' else t_lib) * 1e3:11.0f}")
            for wname, kind, src, text in WORKLOADS:
                tokens = gvocab.tokenizer.tokenize_bytes(text.encode())
                t_c, t_m, n = time_masks(lib, kind, src, tokens)
                print(f"{name:14} {vocab.n_tokens:8} {wname:12} {lib.name:11} {t_c * 1e3:11.1f} {t_m * 1e3:8.3f} "
                      f"{n:4}/{len(tokens):<3}")
        for density in (0.01, 0.5):
            app = apply_times(vocab.n_tokens, density)
            dev = app.pop("device")
            for how, t in app.items():
                print(f"{name:14} {vocab.n_tokens:8} {'apply mask':12} {density:4.0%} allowed, {how} on {dev}: "
                      f"{t * 1e3:.3f} ms")

    if args.generate:
        print(f"\n## generation speed, JSON schema vs none (median of {args.runs} interleaved runs, temp 0.8)")
        for name in args.generate:
            generation_speed(name, args.runs)


if __name__ == "__main__":
    main()
