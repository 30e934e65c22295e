"""The recipes of docs/guides/integrations.md, run on the CPU with a model built here: Hugging Face
Trainer (an optimizer passed in, or a class and its arguments), accelerate and Lightning (bf16-mixed with gradient
clipping, and fp16-mixed with a GradScaler and clipping). Each resumes from a checkpoint and must
end where the uninterrupted run ends, bit for bit: the optimizer states go through each library's
own checkpoint files. The libraries are test dependencies (requirements-test-integrations.txt),
imported inside the tests so that collecting the suite stays fast; a test skips where its library is not
installed (tests/optional_packages.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fusedoff
from tests.optional_packages import require

STEPS, RESUME_AT, BATCH = 8, 4, 4


class Regression(Dataset):
    """32 samples of a fixed random linear map with noise, as dicts (the form Trainer feeds a model)."""

    def __init__(self, samples: int = BATCH * STEPS) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, 8, generator=gen)
        self.y = self.x @ torch.randn(8, generator=gen) + 0.1 * torch.randn(samples, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.net(x).squeeze(-1)
        return {"loss": F.mse_loss(out.float(), labels.float()), "logits": out}


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def assert_trained(model: nn.Module) -> None:
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), TinyModel().parameters()))


@pytest.fixture
def fresh_accelerate_state():
    """Trainer and Accelerator keep process-wide state (AcceleratorState): each of their tests starts clean."""
    require("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


# ---- Hugging Face Trainer ------------------------------------------------------------------------

def hf_trainer(tmp_path, how: str, max_steps: int):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=BATCH,
                             learning_rate=1e-2, weight_decay=0.1, lr_scheduler_type="linear", save_strategy="steps",
                             save_steps=RESUME_AT, logging_strategy="no", report_to=[], use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    model = TinyModel()
    if how == "optimizers":
        # Streamed states (host memory through 32-element chunks) go through Trainer's files too.
        opt = fusedoff.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload="stream", chunk_size=32)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / STEPS)
        kwargs = dict(optimizers=(opt, sched))
    else:
        kwargs = dict(optimizer_cls_and_kwargs=(fusedoff.AdamW, {"lr": 1e-2, "betas": (0.9, 0.99)}))
    return Trainer(model=model, args=args, train_dataset=Regression(), **kwargs)


@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs"])
def test_hugging_face_trainer_resumes_exactly(tmp_path, how, fresh_accelerate_state):
    require("transformers")
    whole = hf_trainer(tmp_path / "whole", how, STEPS)
    whole.train()
    opt = whole.optimizer.optimizer  # inside accelerate's AcceleratedOptimizer
    assert isinstance(opt, fusedoff.AdamW)
    assert_trained(whole.model)
    if how == "optimizer_cls_and_kwargs":  # Trainer's decay / no-decay groups reach fusedoff
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        assert opt.param_groups[0]["betas"] == (0.9, 0.99)

    resumed = hf_trainer(tmp_path / "resumed", how, STEPS)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / f"checkpoint-{RESUME_AT}"))
    assert_same_params(whole.model, resumed.model)


# ---- accelerate ----------------------------------------------------------------------------------

def accelerate_run(steps: range, save_to=None, load_from=None) -> nn.Module:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = TinyModel()
    opt = fusedoff.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / STEPS)
    loader = DataLoader(Regression(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if load_from is not None:
        accelerator.load_state(load_from)
        loader = accelerator.skip_first_batches(loader, steps.start)
    for step, batch in zip(steps, loader):
        loss = model(**batch)["loss"]
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if save_to is not None and step + 1 == RESUME_AT:
            accelerator.save_state(save_to)
    return accelerator.unwrap_model(model)


def test_accelerate_bf16_with_clipping_resumes_exactly(tmp_path, fresh_accelerate_state):
    whole = accelerate_run(range(STEPS), save_to=tmp_path / "state")
    assert_trained(whole)
    resumed = accelerate_run(range(RESUME_AT, STEPS), load_from=tmp_path / "state")
    assert_same_params(whole, resumed)


# ---- Lightning -----------------------------------------------------------------------------------

def lightning_module():
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyModel()

        def training_step(self, batch, batch_idx):
            return self.model(**batch)["loss"]

        def configure_optimizers(self):
            opt = fusedoff.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / STEPS)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module()


def lightning_fit(tmp_path, precision: str, epochs: int, ckpt_path=None):
    import lightning as L

    plugins = []
    if precision == "16-mixed":
        # Lightning turns 16-mixed on the CPU into bf16; a plugin keeps fp16 with a GradScaler.
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), **({"plugins": plugins} if plugins else {"precision": precision}))
    module = lightning_module()
    # One epoch is RESUME_AT steps: the checkpoint falls between epochs, where Lightning resumes a
    # plain DataLoader at the same batch.
    trainer.fit(module, DataLoader(Regression(BATCH * RESUME_AT), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_mixed_precision_with_gradient_clipping_resumes_exactly(tmp_path, precision):
    """Lightning refuses gradient_clip_val for an optimizer that says it unscales inside its step
    (torch's fused AdamW); fusedoff says so to GradScaler only, so both precisions clip."""
    require("lightning")
    whole_trainer, whole = lightning_fit(tmp_path, precision, epochs=2)
    assert whole_trainer.global_step == STEPS
    assert_trained(whole.model)
    half_trainer, _ = lightning_fit(tmp_path, precision, epochs=1)
    half_trainer.save_checkpoint(tmp_path / "half.ckpt")
    resumed_trainer, resumed = lightning_fit(tmp_path, precision, epochs=2, ckpt_path=tmp_path / "half.ckpt")
    assert resumed_trainer.global_step == STEPS
    assert_same_params(whole.model, resumed.model)
