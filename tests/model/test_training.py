"""The training loop, tasks, checkpoints and the train/generate commands, on small settings."""

import json

import numpy as np
import pytest

from attngrad.cli.main import main
from attngrad.model import PAD, TransformerConfig, init_params
from attngrad.model.layers import layer_norm_backward, layer_norm_forward
from attngrad.model.loss import cross_entropy_backward, cross_entropy_forward
from attngrad.model.optim import Adam, clip_grad_norm, warmup_lr
from attngrad.model.tasks import CharVocab, ToyData, parse_digits, tokens_to_digits, transform
from attngrad.model.training import TrainConfig, exact_match, load_checkpoint, save_checkpoint, train

SMALL = TransformerConfig(vocab_size=13, d_model=16, heads=2, d_ff=32, layers=1, dropout=0.0)


def test_tasks_and_held_out_split():
    assert transform("reverse", [3, 1, 4]) == [4, 1, 3] and transform("sort", [3, 1, 4]) == [1, 3, 4]
    data = ToyData("reverse", 5, 6, seed=0, held_out=50)
    held = {tuple(s) for s in data.held_out}
    batch = data.batch(200)
    sources = [tuple(tokens_to_digits(list(row))) for row in batch.src]
    assert not held & set(sources)  # training never draws a held-out sequence
    assert batch.tgt_in[0, 0] == 1 and (batch.tgt_out != PAD).sum() == batch.tokens
    assert parse_digits("3 1 4") == [3, 1, 4] == parse_digits("314")
    with pytest.raises(ValueError, match="digits"):
        parse_digits("3 x 4")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        CharVocab("ab").encode("abc")


def test_layer_norm_and_loss_against_finite_differences():
    rng = np.random.default_rng(0)
    x, gamma, beta, dy = rng.standard_normal((3, 5)), rng.standard_normal(5), rng.standard_normal(5), rng.standard_normal((3, 5))
    _, cache = layer_norm_forward(x, gamma, beta)
    dx, _, _ = layer_norm_backward(dy, cache)
    eps = 1e-6
    fd = np.zeros_like(x)
    for index in np.ndindex(*x.shape):
        step = np.zeros_like(x)
        step[index] = eps
        fd[index] = np.sum(dy * (layer_norm_forward(x + step, gamma, beta)[0] - layer_norm_forward(x - step, gamma, beta)[0])) / (2 * eps)
    assert np.abs(dx - fd).max() < 1e-8
    logits, targets = rng.standard_normal((4, 6)), np.array([1, 0, 3, 5])  # target 0 is padding
    loss, cache = cross_entropy_forward(logits, targets, pad=0, smoothing=0.1)
    grad = cross_entropy_backward(cache)
    assert (grad[1] == 0).all()
    step = np.zeros_like(logits)
    step[2, 4] = eps
    fd = (cross_entropy_forward(logits + step, targets, pad=0, smoothing=0.1)[0]
          - cross_entropy_forward(logits - step, targets, pad=0, smoothing=0.1)[0]) / (2 * eps)
    assert abs(grad[2, 4] - fd) < 1e-8


def test_schedule_clipping_and_adam():
    assert warmup_lr(400, 64, 400) == pytest.approx(64**-0.5 * 400**-0.5)  # the peak, at the end of warm-up
    assert warmup_lr(100, 64, 400) < warmup_lr(400, 64, 400) > warmup_lr(1600, 64, 400)
    grads = {"a": np.full(4, 3.0), "b": np.full(4, 4.0)}
    assert clip_grad_norm(grads, 1.0) == pytest.approx(10.0)
    assert np.sqrt(sum((g**2).sum() for g in grads.values())) == pytest.approx(1.0, rel=1e-5)
    params = {"w": np.array([1.0, -2.0])}
    optimizer = Adam(params)
    for _ in range(200):
        optimizer.step({"w": 2 * params["w"]}, 0.05)  # minimise |w|^2
    assert np.abs(params["w"]).max() < 0.05
    with pytest.raises(ValueError, match="differ in their names"):
        optimizer.step({"v": np.zeros(2)}, 0.1)


def test_training_learns_copy_and_checkpoint_round_trip(tmp_path):
    """A short run on copy must move well above chance (1/10 per digit), and its checkpoint
    must load and decode identically."""
    config = TrainConfig(task="copy", steps=300, batch_size=32, min_len=2, max_len=4, warmup=100, eval_every=100,
                         held_out=100, stop_at=None, seed=1)
    seen = []
    result = train(config, SMALL, out=tmp_path, report=seen.append)
    assert [s["step"] for s in seen] == list(range(1, 301))
    assert result.history.loss[-1] < result.history.loss[0]
    assert result.accuracy > 0.3
    assert (tmp_path / "model.npz").exists() and (tmp_path / "history.json").exists()
    ckpt = load_checkpoint(tmp_path / "model.npz")
    assert ckpt.model == result.model and ckpt.train.task == "copy"
    held = ToyData("copy", 2, 4, seed=1, held_out=100).held_out
    assert exact_match(ckpt.params, ckpt.model, "copy", held) == result.accuracy
    # resume: the optimizer state and step count carry over
    resumed = train(TrainConfig(**{**config.__dict__, "steps": 320}), out=tmp_path / "more", resume=tmp_path / "model.npz")
    assert resumed.steps == 320 and len(resumed.history.steps) == len(result.history.steps) + 1


def test_checkpoints_refuse_pickles_and_mismatched_shapes(tmp_path):
    params = init_params(SMALL, np.random.default_rng(0))
    good = save_checkpoint(tmp_path / "good.npz", params, SMALL, TrainConfig())
    assert load_checkpoint(good).params.keys() == params.keys()
    with np.load(good) as data:
        arrays = dict(data)
    arrays["param.out.b"] = np.zeros(7, dtype=np.float32)
    np.savez(tmp_path / "shape.npz", **arrays)
    with pytest.raises(ValueError, match=r"out.b has shape \(7,\)"):
        load_checkpoint(tmp_path / "shape.npz")
    arrays["param.out.b"] = np.array([{"evil": 1}], dtype=object)
    np.savez(tmp_path / "pickle.npz", **arrays)
    with pytest.raises(ValueError, match="pickled Python objects"):
        load_checkpoint(tmp_path / "pickle.npz")
    meta = json.loads(str(arrays["meta"]))
    meta["model"]["d_model"] = 32
    arrays.update(meta=np.array(json.dumps(meta)), **{"param.out.b": params["out.b"]})
    np.savez(tmp_path / "config.npz", **arrays)
    with pytest.raises(ValueError, match="the configuration says"):
        load_checkpoint(tmp_path / "config.npz")
    meta["model"]["d_model"] = "wide"
    np.savez(tmp_path / "meta.npz", **{**arrays, "meta": np.array(json.dumps(meta))})
    with pytest.raises(ValueError, match="configuration cannot be read"):
        load_checkpoint(tmp_path / "meta.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable"):
        load_checkpoint(tmp_path / "junk.npz")


def test_train_and_generate_commands(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "reverse", "--steps", "20", "--batch-size", "8", "--d-model", "16", "--heads", "2",
                 "--d-ff", "32", "--layers", "1", "--eval-every", "10", "--max-len", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out.replace("\n", "")  # rich folds a long path over lines
    assert "held-out exact match" in text and str(out / "model.npz") in text
    assert main(["generate", "--checkpoint", str(out / "model.npz"), "3 1 4"]) == 0
    decoded = capsys.readouterr().out.split()
    assert all(d.isdigit() for d in decoded) and len(decoded) <= 4
    assert main(["generate", "--checkpoint", str(out / "model.npz"), "3 x"]) == 2
    assert "expected digits" in capsys.readouterr().err
    assert main(["train", "--task", "reverse", "--d-model", "10", "--heads", "4", "--out", str(tmp_path / "x")]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_language_model_command(tmp_path, capsys):
    out = tmp_path / "lm"
    assert main(["train", "--task", "lm", "--steps", "10", "--batch-size", "4", "--window", "16", "--d-model", "16",
                 "--heads", "2", "--d-ff", "32", "--layers", "1", "--eval-every", "5", "--out", str(out)]) == 0
    assert "next-char acc" in capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(out / "model.npz"), "The ", "--length", "20"]) == 0
    sample = capsys.readouterr().out
    assert sample.startswith("The ") and len(sample.rstrip("\n")) == 24


def _small_run(tmp_path, *extra):
    out = tmp_path / "run"
    code = main(["train", "--task", "reverse", "--steps", "12", "--batch-size", "8", "--d-model", "16", "--heads", "2",
                 "--d-ff", "32", "--layers", "1", "--eval-every", "6", "--max-len", "4", "--out", str(out), *extra])
    assert code == 0
    return out


@pytest.mark.parametrize("argv,fragment", [
    (["train", "--steps", "-1"], "argument --steps: expected a positive integer; got -1"),
    (["train", "--dropout", "1.5"], "argument --dropout: expected a number in [0, 1)"),
    (["train", "--threads", "0"], "argument --threads: expected a positive integer"),
    (["generate", "--checkpoint", "x.npz", "--length", "-5", "1 2"], "argument --length: expected an integer >= 0"),
    (["generate", "--checkpoint", "x.npz", "--temperature", "-1", "1 2"], "argument --temperature: expected a finite"),
    (["check", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
])
def test_out_of_range_numbers_name_their_flag(capsys, argv, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_train_errors_name_flags_and_files_before_any_bar(tmp_path, capsys):
    assert main(["train", "--min-len", "5", "--max-len", "3", "--out", str(tmp_path / "x")]) == 2
    assert "--min-len 5 exceeds --max-len 3" in capsys.readouterr().err
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 40)
    assert main(["train", "--task", "lm", "--text", str(latin), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    # the message wraps at the terminal's width, at a space or inside the long path: compare
    # with the breaks and spaces taken out (a path one character longer once moved the break)
    assert f"--text {latin}: {latin} is not UTF-8 text (byte 3 is 0xe9)".replace(" ", "") in "".join(err.split())
    assert "train lm" not in err  # no progress bar was drawn
    assert not (tmp_path / "y").exists()


def test_progress_shows_no_accuracy_before_the_first_evaluation(tmp_path):
    from attngrad.model.training import TrainConfig, train
    from attngrad.model.transformer import TransformerConfig

    states = []
    train(TrainConfig(task="reverse", steps=6, batch_size=4, eval_every=3, max_len=4),
          TransformerConfig(vocab_size=4, d_model=8, heads=2, d_ff=16, layers=1), report=states.append)
    assert [s["accuracy"] is None for s in states] == [True, True, False, False, False, False]


def test_train_says_when_it_cannot_draw_curves(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out = _small_run(tmp_path)
    assert not (out / "curves.png").exists()
    out = " ".join(capsys.readouterr().out.split())
    assert "no curves.png: matplotlib is not installed: pip install 'attngrad[docs]' (in a clone: pip install -e '.[docs]')" in out


def test_generate_warns_outside_the_trained_lengths(tmp_path, capsys):
    out = _small_run(tmp_path)  # trained on 3 to 4 digits
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(out / "model.npz"), "7"]) == 0
    assert "the prompt has 1 digits, but this model was trained on 3 to 4" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(out / "model.npz"), "7 1 2"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_train_bounds_its_blas_threads(tmp_path, monkeypatch):
    """--threads reaches the BLAS through threadpoolctl (default 1: the model's matrices are small)."""
    import threadpoolctl

    seen = []
    real = threadpoolctl.threadpool_limits

    def spy(limits=None, user_api=None):
        seen.append((limits, user_api))
        return real(limits=limits, user_api=user_api)

    monkeypatch.setattr(threadpoolctl, "threadpool_limits", spy)
    _small_run(tmp_path)
    _small_run(tmp_path, "--threads", "2")
    assert seen == [(1, "blas"), (2, "blas")]
