"""LoRA fine-tuning (issue 31, part 2) on a tiny random model: the loss of a small synthetic task
(continue any prompt with the same five tokens) falls, the step compiles once, the gradient
through the lowered graph matches finite differences and its loss the decoded one, the written
adapter loads with llm.adapter_lora_init and continues the pattern, bad data names file and
line, a non-finite loss stops with the last good adapter kept, and the CLI drives it all."""
from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TinySpec, model_tensors, write_model

import llm
from llm import finetune as ft
from llm import params
from llm.adapter import adapter_lora_init, write_lora
from llm.batch import Batch

SPEC = TinySpec(n_layer=2, seed=5)
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "rock", "fish"]
COMPLETION = " a b c d e"
CONFIG = ft.LoraConfig(rank=4, alpha=8.0, learning_rate=1e-2, iters=30, batch_size=4, steps_per_eval=10,
                       num_layers=-1, val_batches=-1)

_compiles = [0]


def _count(event: str, duration: float, **kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def rows(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt": " ".join(rng.choice(WORDS, 3)) + " :", "completion": COMPLETION} for _ in range(n)]


def write_jsonl(path, items) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune")
    data = d / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", rows(64, seed=0))
    write_jsonl(data / "valid.jsonl", rows(8, seed=1))
    write_jsonl(data / "test.jsonl", rows(4, seed=2))
    return {"dir": d, "data": data, "base": write_model(d / "base.gguf", SPEC)}


@pytest.fixture(scope="module")
def model(files):
    return llm.load_model(files["base"])


@pytest.fixture(scope="module")
def model_q8(files):
    """The same model with Q8_0 matrices, held quantized (int8) as loaded."""
    m = llm.load_model(write_model(files["dir"] / "q8.gguf", dataclasses.replace(SPEC, wtype="Q8_0")))
    assert m.layers[0].wq.data.spec.format == "int8"
    return m


@pytest.fixture(scope="module")
def trained(files, model):
    infos, compiles = [], []

    def cb(info):
        infos.append(info)
        compiles.append(_compiles[0])

    path = files["dir"] / "adapter.gguf"
    data = ft.load_data(files["data"])
    result = ft.train(model, data["train"], data["valid"], CONFIG, callback=cb, adapter_path=path)
    return {"result": result, "infos": infos, "compiles": compiles, "path": path}


@pytest.mark.slow
def test_validation_loss_falls(trained):
    r = trained["result"]
    # measured: 9.72 -> 0.0019 in 30 steps of 4 x 24 tokens (train loss 9.44 -> 0.0018)
    assert r.val_loss_end <= 0.6 * r.val_loss_start
    assert r.val_loss_start > 5.0 and r.val_loss_end < 0.1
    assert [s for s, _ in r.val_loss] == [0, 10, 20, 30]
    assert r.steps == len(r.train_loss) == 30 and r.train_loss[-1] < 0.1 * r.train_loss[0]
    assert r.seq_len == 24 and r.tokens_per_s > 0 and r.peak_rss_mb > 0 and r.n_compiles == 2
    infos = trained["infos"]
    assert [i.step for i in infos] == list(range(1, 31))
    assert [i.val_loss is not None for i in infos].count(True) == 3
    assert infos[0].learning_rate == pytest.approx(1e-2) and infos[-1].learning_rate < 1e-3   # cosine decay
    assert json.loads(json.dumps(r.report()))["val_loss_end"] == r.val_loss_end


def test_warm_up_then_cosine_decay():
    lr = ft._schedule(ft.LoraConfig(learning_rate=1.0, warmup=4, iters=12))
    got = [float(lr(k)) for k in range(12)]
    np.testing.assert_allclose(got[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    assert all(a > b for a, b in zip(got[3:], got[4:], strict=False)) and got[-1] < 0.05
    flat = ft._schedule(ft.LoraConfig(learning_rate=1.0, iters=12))
    assert float(flat(0)) == 1.0 and float(flat(6)) == pytest.approx(0.5)


def test_no_recompiles_after_the_first_step(trained):
    compiles = trained["compiles"]
    assert compiles[-1] == compiles[0], f"XLA compiled during training: {compiles}"


@pytest.mark.slow
def test_the_written_adapter_continues_the_pattern(files, model, trained):
    adapter = adapter_lora_init(model, trained["path"])
    assert adapter.alpha == 8.0 and len(adapter.weights) == 14      # 7 targets x 2 layers
    assert adapter.weights["blk.0.attn_q.weight"].rank == 4
    prompt = rows(1, seed=7)[0]["prompt"]
    want = model.vocab.tokenize(COMPLETION, add_special=False, parse_special=True)
    tuned = llm.LLM(files["base"], lora=[(trained["path"], 1.0)], n_ctx=128)
    out = tuned.generate(prompt, 12, temperature=0.0)
    assert out.tokens == want and out.finish_reason == "eog"
    bare = llm.LLM(files["base"], n_ctx=128).generate(prompt, 12, temperature=0.0)
    assert bare.tokens[:len(want)] != want


def random_pairs(names, rank=3, seed=3):
    rng = np.random.default_rng(seed)
    w = model_tensors(SPEC)
    return {n: ((rng.standard_normal((rank, w[n].shape[1])) * 0.2).astype(np.float32),
                (rng.standard_normal((w[n].shape[0], rank)) * 0.2).astype(np.float32)) for n in names}


def decoded_loss(model, adapter, examples) -> float:
    """The mean weighted token loss, each example alone through Context.decode."""
    ctx = llm.Context(model, n_ctx=64, n_batch=32, n_ubatch=32)
    ctx.set_adapters_lora([adapter], [1.0])
    total, count = 0.0, 0.0
    for e in examples:
        ctx.memory_clear()
        assert ctx.decode(Batch(e.tokens, logits=np.ones(e.tokens.size, bool))) == 0
        lg = ctx.get_logits().astype(np.float64)[:-1]
        lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
        ce = lse - lg[np.arange(lg.shape[0]), e.tokens[1:]]
        total += float((ce * e.weight[1:]).sum())
        count += float(e.weight[1:].sum())
    return total / count


@pytest.mark.slow
def test_gradient_matches_finite_differences_and_the_loss_the_decoded_one(model_q8, tmp_path):
    """Through the frozen Q8_0 weights as held (int8): no dequantized copy is trained against."""
    model = model_q8
    pairs = random_pairs(["blk.0.attn_q.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight"])
    g = ft._TrainGraph(model, ft._adapter(model, pairs, 6.0), 2, 16, dropout=0.0, remat=False)
    examples = ft.encode(model, [ft.Row("a", {"prompt": "red cat :", "completion": COMPLETION}),
                                 ft.Row("b", {"text": "the moon and the sun"})])
    a = ft._pack(examples, 2, 16, pad=2)
    tokens, targets, weight = (jnp.asarray(x) for x in (a.tokens, a.targets, a.weight))

    def loss(p):
        s, n = ft._cross_entropy(g.logits(p, g.frozen, g.inputs, g.states, tokens, None), targets, weight)
        return s / n

    vg = jax.jit(jax.value_and_grad(loss))
    p = g.params()
    val, grad = vg(p)
    rng = np.random.default_rng(0)
    norm = np.sqrt(sum(float(jnp.vdot(x, x)) for x in grad.values()))
    toward = {k: np.asarray(x) / norm for k, x in grad.items()}          # the gradient's own direction
    d = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()}
    d_norm = np.sqrt(sum(float((x * x).sum()) for x in d.values()))
    random = {k: x / d_norm for k, x in d.items()}
    eps = 1e-2
    for direction, tol in ((toward, 1e-2 * norm), (random, 1e-3)):
        plus, _ = vg({k: p[k] + eps * direction[k] for k in p})
        minus, _ = vg({k: p[k] - eps * direction[k] for k in p})
        fd = (float(plus) - float(minus)) / (2 * eps)
        analytic = sum(float(jnp.vdot(grad[k], direction[k])) for k in p)
        assert abs(fd - analytic) < tol, (fd, analytic)        # measured: 4.1555 vs 4.1571, 0.03500 vs 0.03498
    # the packed step (two sequences of one ubatch, kept apart by the KV mask) computes the loss
    # that decoding each example alone with the adapter file gives
    write_lora(tmp_path / "a.gguf", "llama", pairs, alpha=6.0)
    ref = decoded_loss(model, adapter_lora_init(model, tmp_path / "a.gguf"), examples)
    assert float(val) == pytest.approx(ref, rel=1e-4)      # measured: 9.754212 vs 9.754212


def test_encode_weights_completions_and_assistant_turns(model):
    v = model.vocab
    (pc,) = ft.encode(model, [ft.Row("x", {"prompt": "red cat :", "completion": COMPLETION})])
    n_prompt = len(v.tokenize("red cat :", add_special=True, parse_special=True))
    assert pc.tokens[-1] == v.eos and not pc.weight[:n_prompt].any() and pc.weight[n_prompt:].all()
    (every,) = ft.encode(model, [ft.Row("x", {"prompt": "red cat :", "completion": COMPLETION})], mask_prompt=False)
    assert every.weight[1:].all() and not every.weight[0]
    msgs = [{"role": "user", "content": "moon"}, {"role": "assistant", "content": "sun"},
            {"role": "user", "content": "tree"}, {"role": "assistant", "content": "rock"}]
    (chat,) = ft.encode(model, [ft.Row("x", {"messages": msgs})])
    text = v.detokenize(chat.tokens[chat.weight].tolist())
    assert "sun" in text and "rock" in text and "moon" not in text and "tree" not in text


def test_dataset_errors_name_the_file_and_line(tmp_path, model):
    d = tmp_path / "data"
    d.mkdir()
    good = json.dumps({"text": "red cat"})
    for body, match in ((f"{good}\n{{oops\n", r"train.jsonl:2: not JSON"),
                        (f"{good}\n\n" + json.dumps({"question": "x"}) + "\n", r"train.jsonl:3: a row needs 'text'"),
                        (json.dumps({"prompt": "a", "completion": 5}) + "\n", r"train.jsonl:1: 'completion' must be"),
                        (json.dumps({"messages": [{"role": "user"}]}) + "\n", r"train.jsonl:1: messages\[0\]"),
                        ("[1, 2]\n", r"train.jsonl:1: a row must be a JSON object")):
        (d / "train.jsonl").write_text(body)
        with pytest.raises(ft.DatasetError, match=match):
            ft.read_jsonl(d / "train.jsonl")
    (d / "train.jsonl").write_text(good + "\n")
    with pytest.raises(ft.DatasetError, match="valid.jsonl: no such file"):
        ft.load_data(d)
    (d / "valid.jsonl").write_text("\n")
    data = ft.load_data(d)
    with pytest.raises(ft.DatasetError, match="the valid set is empty"):
        ft.train(model, data["train"], data["valid"], CONFIG)
    with pytest.raises(ft.DatasetError, match=r"valid\[1\]: a row needs"):
        ft.train(model, data["train"], [{"text": "a"}, {"txt": "b"}], CONFIG)


@pytest.mark.slow
def test_a_non_finite_loss_stops_and_keeps_the_last_good_adapter(files, model, tmp_path):
    # Adam's first step moves every entry by ~lr: 1e20 overflows the next forward pass (an llm.LLM
    # trains as its model does)
    config = ft.LoraConfig(rank=4, alpha=8.0, learning_rate=1e20, iters=5, batch_size=4, num_layers=-1)
    path = tmp_path / "nan.gguf"
    with pytest.raises(ft.TrainingError, match=r"step 2: the training loss is nan; training stopped, the "
                                               r"starting adapter, written to .*nan.gguf") as e:
        ft.train(llm.LLM(files["base"], n_ctx=64), rows(16, seed=0), rows(4, seed=1), config, adapter_path=path)
    assert e.value.step == 2 and e.value.result.steps == 1
    adapter = adapter_lora_init(model, path)
    kept = e.value.result.adapter
    assert all(np.isfinite(a).all() and np.isfinite(b).all() and not b.any() for a, b in kept.values())
    assert len(adapter.weights) == len(kept)


@pytest.mark.slow
def test_cli_resumes_and_reports(files, trained, tmp_path, capsys):
    from llm.cli import finetune as cli
    from llm.cli.commands import Interrupt
    ap = argparse.ArgumentParser()
    cli.add_parser(ap.add_subparsers())
    out, report = tmp_path / "more.gguf", tmp_path / "report.json"
    a = ap.parse_args(["finetune", "-m", str(files["base"]), "--data", str(files["data"]), "--iters", "4",
                       "--batch-size", "4", "--learning-rate", "1e-3", "--steps-per-eval", "2", "--val-batches", "-1",
                       "--resume-adapter-file", str(trained["path"]), "--adapter-path", str(out),
                       "--report", str(report), "--test"])
    a.interrupt = Interrupt()
    assert a.fn(a) == 0
    err = capsys.readouterr()
    lines = [ln for ln in err.err.splitlines() if ln.startswith("step ")]
    assert lines[0].startswith("step 1/4 | loss ") and "tok/s | eta" in lines[0]
    assert sum("val loss" in ln for ln in lines) == 2
    assert "val loss" in err.out and str(out) in err.out and "test loss" in err.out
    rep = json.loads(report.read_text())
    assert {"val_loss_start", "val_loss_end", "train_loss", "tokens_per_s", "peak_rss_mb"} <= set(rep)
    # resumed: it starts where the first run ended
    assert rep["val_loss_start"] == pytest.approx(trained["result"].val_loss_end, rel=1e-3, abs=1e-4)
    assert len(rep["train_loss"]) == 4 and rep["test_loss"] < 0.1
    assert adapter_lora_init(llm.load_model(files["base"]), out).alpha == 8.0


def test_cli_flags_are_mlx_lms():
    from llm.cli import finetune as cli
    ap = argparse.ArgumentParser()
    cli.add_parser(ap.add_subparsers())
    a = ap.parse_args(["finetune", "--data", "d", "--iters", "7", "--batch-size", "2", "--learning-rate", "3e-4",
                       "--lora-rank", "16", "--lora-alpha", "32", "--lora-dropout", "0.1", "--num-layers", "4",
                       "--max-seq-length", "512", "--steps-per-eval", "5", "--val-batches", "3", "--grad-checkpoint",
                       "--seed", "9", "--no-mask-prompt", "--lora-targets", "attn_q,attn_v"])
    c = params.from_namespace(ft.LoraConfig, a)
    assert c == ft.LoraConfig(rank=16, alpha=32.0, dropout=0.1, num_layers=4, targets=("attn_q", "attn_v"),
                              learning_rate=3e-4, iters=7, batch_size=2, max_seq_length=512, steps_per_eval=5,
                              val_batches=3, grad_checkpoint=True, seed=9, mask_prompt=False)
    assert ap.parse_args(["finetune", "--data", "d"]).mask_prompt is True


@pytest.mark.slow
def test_grad_checkpoint_and_dropout_keep_the_math(model):
    pairs = random_pairs(["blk.0.attn_k.weight", "blk.1.ffn_up.weight"])
    examples = ft.encode(model, [ft.Row("a", {"text": "red cat sat"}), ft.Row("b", {"text": "sun"})])
    a = ft._pack(examples, 2, 16, pad=2)
    tokens, targets, weight = (jnp.asarray(x) for x in (a.tokens, a.targets, a.weight))

    def value_and_grad(graph, key=None):
        def loss(p):
            lg = graph.logits(p, graph.frozen, graph.inputs, graph.states, tokens, key)
            s, n = ft._cross_entropy(lg, targets, weight)
            return s / n
        return jax.jit(jax.value_and_grad(loss))(graph.params())

    plain = ft._TrainGraph(model, ft._adapter(model, pairs, 4.0), 2, 16, dropout=0.0, remat=False)
    remat = ft._TrainGraph(model, ft._adapter(model, pairs, 4.0), 2, 16, dropout=0.0, remat=True)
    drop = ft._TrainGraph(model, ft._adapter(model, pairs, 4.0), 2, 16, dropout=0.5, remat=False)
    (v0, g0), (v1, g1) = value_and_grad(plain), value_and_grad(remat)
    assert float(v1) == pytest.approx(float(v0), rel=1e-6)
    for k in g0:
        np.testing.assert_allclose(np.asarray(g1[k]), np.asarray(g0[k]), rtol=1e-5, atol=1e-6)
    (v2, _), (v3, _) = value_and_grad(drop), value_and_grad(drop, jax.random.key(1))
    assert float(v2) == pytest.approx(float(v0), rel=1e-6)      # masks of ones: the plain graph
    assert abs(float(v3) - float(v0)) > 1e-4
    assert len(drop.drop_pos) == 2
