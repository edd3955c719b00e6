"""transformers ``Trainer`` on CPU under torchrun (2 ranks): a tiny GPT-2 built from a
``GPT2Config`` (nothing downloaded), 4 training steps, then ``evaluate()`` (the evaluation
loop gathers losses across ranks), with Trainer's defaults otherwise."""

import sys
import tempfile

import fw_common

fw_common.patch()

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossTrainer(Trainer):
    """Prints each training step's loss exactly (Trainer's own log rounds it)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        out = super().compute_loss(model, inputs, *args, **kwargs)
        if model.training:
            loss = out[0] if isinstance(out, tuple) else out
            fw_common.loss(self.args.process_index, self.state.global_step, loss.item())
        return out


class Watch(TrainerCallback):
    def __init__(self):
        self.trainer = None

    def on_train_begin(self, args, state, control, **kwargs):
        fw_common.watch(self.trainer.model_wrapped)


def main() -> None:
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, max_steps=4,
                                 per_device_train_batch_size=4, per_device_eval_batch_size=4,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no",
                                 report_to=[], disable_tqdm=True, seed=0)
        watch = Watch()
        trainer = LossTrainer(model=model, args=args, train_dataset=Tokens(32, 1),
                              eval_dataset=Tokens(16, 2), callbacks=[watch])
        watch.trainer = trainer
        trainer.train()  # CALL:bucket
        metrics = trainer.evaluate()  # CALL:gather
    sys.stdout.write(f"EVAL {args.process_index} {float(metrics['eval_loss']).hex()}\n")
    sys.stdout.flush()  # out before teardown, where gloo now and then aborts the process
    fw_common.teardown()


if __name__ == "__main__":
    main()
