"""transformers' Trainer and TRL's SFTTrainer, unmodified, on a tiny GPT-2 built locally (no
Hub, no network). Run it under `mpaccel run`, at any world size:

    mpiexec -n 2 python -m mpaccel run tests/jobs/hf_training.py OUT 4 [fsdp]

with the per-device batch (4 at two ranks is the global batch of 8 at one).

Trainer: evaluate, train 10 steps (a checkpoint at step 5), save, predict, then resume from
step 5 in a new Trainer; with `fsdp`, all of it under FSDP2 (and no SFT). SFTTrainer: 6 steps
over pre-tokenized rows, with a word-level tokenizer built here. The main process writes
OUT/result.json with every step's loss and gradient norm; tests/jobs/test_run.py compares them."""

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

out, per_device = sys.argv[1], int(sys.argv[2])
fsdp = sys.argv[3:] == ["fsdp"]


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int) -> None:
        self.ids = torch.randint(2, 64, (count, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2() -> GPT2LMHeadModel:
    """Dropout off, so that every world size computes the same losses."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return GPT2LMHeadModel(config)


def steps(trainer) -> dict:
    return {str(e["step"]): [e["loss"], e["grad_norm"]] for e in trainer.state.log_history
            if "loss" in e}


def trainer_run() -> dict:
    def arguments() -> TrainingArguments:
        extra = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if fsdp else {}
        return TrainingArguments(
            output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=per_device,
            per_device_eval_batch_size=4, max_steps=10, learning_rate=1e-3, logging_steps=1,
            save_steps=5, report_to=[], seed=0, use_cpu=True, disable_tqdm=True, **extra)

    train, held_out = Tokens(160, 1), Tokens(8, 2)
    trainer = Trainer(model=gpt2(), args=arguments(), train_dataset=train,
                      eval_dataset=held_out)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    trained = steps(trainer)
    final = os.path.join(out, "trainer", "final")
    trainer.save_model(final)
    predicted = trainer.predict(held_out)
    wrapped = type(trainer.model_wrapped).__name__
    resumed = Trainer(model=gpt2(), args=arguments(), train_dataset=train)
    resumed.train(resume_from_checkpoint=os.path.join(out, "trainer", "checkpoint-5"))
    return {"steps": trained, "resumed": steps(resumed), "eval_loss": before,
            "predictions": list(predicted.predictions.shape), "wrapped": wrapped,
            "world": trainer.accelerator.num_processes,
            "saved": sorted(os.listdir(final)) if os.path.isdir(final) else []}


def sft_run() -> dict:
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 64)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>", eos_token="<eos>")
    rows = torch.randint(2, 64, (48, 15), generator=torch.Generator().manual_seed(3))
    rows = torch.cat([rows, torch.ones(48, 1, dtype=torch.long)], dim=1)  # each ends in <eos>
    args = SFTConfig(output_dir=os.path.join(out, "sft"), per_device_train_batch_size=per_device,
                     max_steps=6, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                     report_to=[], seed=0, use_cpu=True, bf16=False, disable_tqdm=True,
                     max_length=16)
    trainer = SFTTrainer(model=gpt2(), args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"input_ids": rows.tolist()}))
    trainer.train()
    return {"steps": steps(trainer), "world": trainer.accelerator.num_processes}


result = {"trainer": trainer_run()}
if not fsdp:
    result["sft"] = sft_run()
from accelerate import PartialState  # noqa: E402  (mpaccel's, under `mpaccel run`)

if PartialState().is_main_process:
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
