"""Training through the device path (``--device``): a tiny GR trained on the CPU by the same code a GPU runs,
cut in the middle of an epoch and resumed from its checkpoint at the step it saved; checkpoints that load on
either device and come in parts; the batch-scaling rule. Tests that need a GPU skip without one."""

import io
import json

import pytest
import torch

from specrec.data import leave_one_out
from specrec.ids import SemanticIds
from specrec.train import checkpoint as ckpt
from specrec.train.device import resolve_device, scale_batch
from specrec.train.trainer import TrainConfig, Trainer

from ..conftest import clustered_embeddings, tiny_config

# the tests count the optimizer's steps by wrapping them, which the scheduler notices
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")


@pytest.fixture(scope="module")
def setup(synth):
    split = leave_one_out(synth, max_history=6)
    emb = clustered_embeddings(synth.n_items, seed=2)
    cfg = tiny_config(level_sizes=[8, 8, 8, 64], d_model=48, d_ff=96, causal_encoder=True, dropout=0.1)
    sem = SemanticIds.fit(emb, n_levels=3, codebook_size=8, collision_size=64, seed=0)
    return split, cfg, sem.assign_all(emb)


class Cut(Exception):
    """The machine went away."""


def _trainer(setup, out, device="cpu", **kw):
    split, cfg, sids = setup
    base = dict(epochs=1, batch_size=32, lr=3e-3, warmup_steps=5, valid_limit=100, patience=50, ema=0.9,
                device=device)
    return Trainer(cfg, TrainConfig(**{**base, **kw}), sids, split.train, split.valid, out, log=lambda s: None)


def _count_steps(tr: Trainer, cut_after: int | None = None) -> list[int]:
    """Count the optimizer's steps (and raise :class:`Cut` after ``cut_after`` of them)."""
    done = [0]
    real = tr.opt.step

    def step(*a, **k):
        if cut_after is not None and done[0] == cut_after:
            raise Cut
        done[0] += 1
        return real(*a, **k)

    tr.opt.step = step  # type: ignore[method-assign]
    return done


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x.cpu(), y.cpu(), atol=1e-6), name


def test_a_run_cut_mid_epoch_resumes_at_the_step_it_saved_and_ends_where_an_uncut_run_does(setup, tmp_path):
    straight = _trainer(setup, tmp_path / "straight")
    straight.fit(progress=False)
    per_epoch = straight.steps_per_epoch
    assert per_epoch >= 6 and straight.step == per_epoch

    # a checkpoint after every step (--checkpoint-minutes 0), in parts; the machine goes away after 4 steps
    first = _trainer(setup, tmp_path / "cut", checkpoint_minutes=0.0, checkpoint_part_mib=0.05)
    _count_steps(first, cut_after=4)
    with pytest.raises(Cut):
        first.fit(progress=False)
    parts = json.loads((tmp_path / "cut" / "checkpoint.pt.parts.json").read_text())["parts"]
    assert len(parts) > 1 and all((tmp_path / "cut" / p).stat().st_size <= 0.05 * ckpt.MIB for p in parts)

    again = _trainer(setup, tmp_path / "cut", checkpoint_minutes=0.0, checkpoint_part_mib=0.05)
    assert again.resume()
    assert (again.epoch, again.step, again.epoch_batches) == (0, 4, 4)  # where it stopped, not from scratch
    steps = _count_steps(again)
    again.fit(progress=False)
    assert steps[0] == per_epoch - 4 and again.step == per_epoch and again.epoch == 1
    _same_weights(straight.model, again.model)  # the epoch's batches, dropout and EMA as if never cut
    log = [json.loads(line) for line in (tmp_path / "cut" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 1 and log[0]["device"] == "cpu" and log[0]["step"] == per_epoch
    assert log[0]["loss"] == pytest.approx(straight.history[0]["loss"], rel=1e-6)


def test_the_train_command_trains_on_the_device_it_is_given_and_resumes(tmp_path, capsys, monkeypatch):
    """``specrec train --device cpu``: one epoch of a tiny GR cut in the middle and run again with the same command,
    which goes on from the checkpoint; the run records its device and batch."""
    from specrec.cli import main

    argv = ["train", "--data", "synthetic", "--protocol", "loo", "--out", str(tmp_path / "run"), "--device", "cpu",
            "--codebook-size", "16", "--levels", "2", "--collision-size", "64", "--d-model", "32", "--heads", "2",
            "--d-kv", "16", "--d-ff", "64", "--enc-layers", "1", "--dec-layers", "1", "--max-history", "8",
            "--causal-encoder", "--epochs", "1", "--batch-size", "16", "--batch-scale", "2", "--valid-limit", "50",
            "--checkpoint-minutes", "0"]
    calls = [0]
    real = torch.optim.AdamW.step

    def cut_at_three(self, *a, **k):
        calls[0] += 1
        if calls[0] == 4:
            raise Cut
        return real(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", cut_at_three)
    with pytest.raises(Cut):
        main(argv)
    monkeypatch.setattr(torch.optim.AdamW, "step", real)
    assert ckpt.load(tmp_path / "run" / "checkpoint.pt")["step"] == 3
    capsys.readouterr()
    assert main(argv) == 0
    assert "resumed from" in capsys.readouterr().out
    meta = json.loads((tmp_path / "run" / "bundle" / "bundle.json").read_text())
    train, summary = meta["train"], meta["training"]
    assert (train["device"], train["batch_size"], train["batch_scale"], train["bf16"]) == ("cpu", 32, 2.0, False)
    assert train["lr"] == pytest.approx(2e-3 * 2**0.5) and train["warmup_steps"] == 250
    assert summary["device"] == "cpu" and summary["devices"] == ["cpu"] and summary["steps"] > 3


def test_a_checkpoint_written_on_a_gpu_loads_on_the_cpu_and_every_saved_tensor_is_a_cpu_one(setup, tmp_path,
                                                                                             monkeypatch):
    tr = _trainer(setup, tmp_path / "a")
    tr.fit(progress=False)
    state = ckpt.load(tr.ckpt_path)

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from tensors(v)
        elif isinstance(x, list | tuple):
            for v in x:
                yield from tensors(v)

    assert all(t.device.type == "cpu" for t in tensors(state))
    # the same run as a GPU machine leaves it: every storage of both files tagged cuda:0
    (tmp_path / "gpu").mkdir()
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    ckpt.save(state, tmp_path / "gpu" / "checkpoint.pt")
    ckpt.save(ckpt.load(tr.best_path, weights_only=True), tmp_path / "gpu" / "best_model.pt")
    monkeypatch.undo()
    if not torch.cuda.is_available():  # the check can fail: without map_location such a file does not load here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO((tmp_path / "gpu" / "checkpoint.pt").read_bytes()), weights_only=False)
    other = _trainer(setup, tmp_path / "gpu", epochs=2)
    assert other.resume() and other.step == tr.step
    assert next(other.model.parameters()).device.type == "cpu"
    last = type(tr.model)(tr.mcfg)
    last.load_state_dict(state["model"])
    _same_weights(last, other.model)
    other.fit(progress=False)  # and it trains on
    assert other.epoch == 2 and other.step == 2 * tr.step


def test_checkpoint_parts_round_trip_replace_each_other_and_refuse_a_wrong_part(tmp_path):
    state = {"w": torch.arange(100_000, dtype=torch.float32), "step": 7}
    path = tmp_path / "c.pt"
    files = ckpt.save(state, path, part_bytes=100_000)
    assert len(files) == 6 and files[-1].name == "c.pt.parts.json" and not path.exists()  # 400 kB in 5 parts
    assert all(f.stat().st_size <= 100_000 for f in files[:-1])
    got = ckpt.load(path)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 7
    assert set(ckpt.files(path)) == set(files)
    ckpt.save({**state, "step": 8}, path, part_bytes=150_000)  # the next checkpoint's parts replace the last's
    assert ckpt.load(path)["step"] == 8 and len(ckpt.files(path)) == 4
    assert len(list(tmp_path.iterdir())) == 4
    ckpt.save({**state, "step": 9}, path)  # one file again: the parts go
    assert ckpt.load(path)["step"] == 9 and ckpt.files(path) == [path] and len(list(tmp_path.iterdir())) == 1
    ckpt.save(state, path, part_bytes=100_000)
    part = ckpt.files(path)[1]
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(ValueError, match="do not match"):
        ckpt.load(path)
    assert ckpt.remove(path) and not ckpt.exists(path) and not list(tmp_path.iterdir())


def test_a_run_resumes_only_with_the_batches_its_checkpoint_counted(setup, tmp_path):
    tr = _trainer(setup, tmp_path)
    tr.fit(progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        _trainer(setup, tmp_path, batch_size=64).resume()


def test_batch_scaling_follows_the_square_root_rule():
    assert scale_batch(48, 1e-3, 1, 500) == (48, 1e-3, 500)
    batch, lr, warm = scale_batch(48, 1e-3, 16, 500)
    assert (batch, warm) == (768, 32) and lr == pytest.approx(4e-3)
    batch, lr, _ = scale_batch(48, 1e-3, 1024 / 48)  # a batch of 1024: the rate follows the batch it got
    assert batch == 1024 and lr == pytest.approx(1e-3 * (1024 / 48) ** 0.5)
    assert scale_batch(256, 2e-3, 0.5)[:2] == (128, pytest.approx(2e-3 / 2**0.5))
    with pytest.raises(ValueError):
        scale_batch(48, 1e-3, 0)


def test_a_device_that_is_not_there_is_a_clear_error():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="cpu or cuda"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


@needs_cuda
@pytest.mark.parametrize("first, then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_run_cut_on_one_device_goes_on_on_the_other(setup, tmp_path, first, then):
    """The 10-minute GPU machine: a run cut there goes on here, and the reverse; bf16 autocast on the GPU."""
    bf16 = {"cuda": True, "cpu": False}
    tr = _trainer(setup, tmp_path, device=first, epochs=2, checkpoint_minutes=0.0, bf16=bf16[first])
    _count_steps(tr, cut_after=5)
    with pytest.raises(Cut):
        tr.fit(progress=False)
    again = _trainer(setup, tmp_path, device=then, epochs=2, checkpoint_minutes=0.0, bf16=bf16[then])
    assert again.resume() and again.step == 5
    assert next(again.model.parameters()).device.type == then
    assert all(s.device.type == then for st in again.opt.state.values() for k, s in st.items() if k != "step")
    again.fit(progress=False)
    assert again.epoch == 2 and [h["device"] for h in again.history][-1] == then
    state = ckpt.load(again.ckpt_path)
    assert state["device"].startswith(then) and all(v.device.type == "cpu" for v in state["model"].values())


@needs_cuda
def test_every_training_stage_runs_on_the_gpu(synth, setup):
    """SASRec, the retrieval drafter, the heads and the distilled drafter train on the GPU and come back on the CPU;
    the frozen GR stays where it was."""
    from specrec.models.sasrec import SASRecConfig
    from specrec.models.tiger import Tiger
    from specrec.train.baseline import train_sasrec
    from specrec.train.distill import DistillConfig, train_sid_mlp
    from specrec.train.drafters import DrafterTrainConfig, train_nezha, train_self_draft

    split, cfg, sids = setup
    tc = DrafterTrainConfig(epochs=1, batch_size=64, valid_limit=100, device="cuda")
    model, rep = train_sasrec(split, [s.items for s in synth.sequences], synth.n_items,
                              SASRecConfig(n_items=synth.n_items, d_model=16, d_ff=32, max_history=6), tc,
                              log=lambda s: None, progress=False)
    assert rep["device"] == "cuda" and next(model.parameters()).device.type == "cpu"
    gr = Tiger(cfg.model_copy(update={"causal_encoder": False})).eval()
    for train in (train_self_draft, train_nezha):
        head, rep = train(gr, split, sids, tc, log=lambda s: None, progress=False)
        assert rep["device"] == "cuda" and next(head.parameters()).device.type == "cpu"
    drafter, rep = train_sid_mlp(gr, split, sids, DistillConfig(examples=200, valid_examples=100, width=4, epochs=1,
                                                                device="cuda"), log=lambda s: None, progress=False)
    assert rep["device"].startswith("cuda") and next(drafter.parameters()).device.type == "cpu"
    assert next(gr.parameters()).device.type == "cpu"
