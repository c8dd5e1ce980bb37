"""The accumulation loop on your own model, loss and data: a small CNN classifying handwritten digits.

    pip install -e ".[vision]"   # scikit-learn, for its bundled digits data set
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml examples/by_feature/image_classification.py

This is ``examples/custom_loop.py`` with its text, GPT-2 and causal-LM loss
swapped for images, a CNN and a classification loss (the diff is marked
``# New Code #``). The data is scikit-learn's bundled digits set
(``sklearn.datasets.load_digits``: 1797 greyscale 8x8 images, 10 classes,
shipped inside the package, no download), split into a training set and a
held-out 20 %. The loss is ``accum_kit.classification_loss``: summed
cross-entropy and the number of examples, so the loop's exact normalisation
averages over every example of the window on all processes.

Before training, ``accum_kit.verify.verify_accumulation`` checks on this model,
loss and data that the accumulated gradient equals one big batch's (a full
and a partial window; exit code 1 if not). After training the script prints
the held-out accuracy. ``--norm batchnorm`` builds the CNN with BatchNorm
instead of GroupNorm: the loop then warns, and verify adds a finding with the
measured deviation (see docs/batchnorm.md).
"""

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import get_scheduler

from accum_kit import build_accelerator, train_loop

# New Code #
from accum_kit import classification_loss, optimizer_steps_per_epoch
from accum_kit.verify import verify_accumulation

NORMS = ("groupnorm", "batchnorm", "none")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # New Code #
    p.add_argument("--norm", default="groupnorm", choices=NORMS, help="normalisation after each convolution")
    p.add_argument("--validation_split_percentage", type=int, default=20, help="held-out share of the 1797 images")
    p.add_argument("--per_device_train_batch_size", type=int, default=16, help="examples per micro-batch per process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=4, help="micro-batches per optimizer step (K)")
    p.add_argument("--num_train_epochs", type=int, default=10, help="passes over the training images")  # New Code #
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# New Code #
def load_digits_splits(validation_split_percentage: int = 20, seed: int = 0):
    """(train, held-out) lists of ``{"pixel_values": float32 (1, 8, 8) in [0, 1], "labels": int64}``, stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()  # pixel intensities 0..16
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, eval_idx = train_test_split(list(range(len(y))), test_size=validation_split_percentage / 100,
                                           random_state=seed, stratify=digits.target)
    return ([{"pixel_values": x[i], "labels": y[i]} for i in train_idx],
            [{"pixel_values": x[i], "labels": y[i]} for i in eval_idx])


# New Code #
class DigitsCNN(torch.nn.Module):
    """Two 3x3 convolutions (16 and 32 channels), each followed by ``norm`` and ReLU, a 2x2 max-pool, a linear head."""

    def __init__(self, norm: str = "groupnorm", num_classes: int = 10):
        super().__init__()

        def norm_layer(channels):
            return {"groupnorm": lambda: torch.nn.GroupNorm(4, channels),
                    "batchnorm": lambda: torch.nn.BatchNorm2d(channels),
                    "none": torch.nn.Identity}[norm]()

        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), norm_layer(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1), norm_layer(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.classifier = torch.nn.Linear(32 * 4 * 4, num_classes)

    def forward(self, pixel_values):
        return self.classifier(self.features(pixel_values).flatten(1))


# New Code #
@torch.no_grad()
def evaluate(accelerator, model, dataloader) -> tuple[float, float]:
    """(mean cross-entropy in nats, accuracy) over the whole held-out split, every process's shard gathered."""
    model.eval()
    logits, labels = [], []
    for batch in dataloader:
        out = model(batch["pixel_values"])
        out, lab = accelerator.gather_for_metrics((out, batch["labels"]))  # drops the padding of the last batch
        logits.append(out)
        labels.append(lab)
    model.train()
    logits, labels = torch.cat(logits), torch.cat(labels)
    loss = torch.nn.functional.cross_entropy(logits.float(), labels).item()
    return loss, (logits.argmax(-1) == labels).float().mean().item()


def main(argv=None) -> dict:
    args = parse_args(argv)
    accelerator = build_accelerator(args.gradient_accumulation_steps)  # cpu=True when needed, process-count check
    train_data, eval_data = load_digits_splits(args.validation_split_percentage, args.seed)  # New Code #
    train_dl = DataLoader(train_data, batch_size=args.per_device_train_batch_size, shuffle=True)
    eval_dl = DataLoader(eval_data, batch_size=64)
    torch.manual_seed(args.seed)  # New Code #
    model = DigitsCNN(args.norm)  # New Code #

    # New Code #
    # Exactness on THIS model, loss and data, before preparing the model (verify deep-copies it).
    report = verify_accumulation(accelerator, model=model, loss_fn=classification_loss, dataset=train_data,
                                 per_device_train_batch_size=args.per_device_train_batch_size, seed=args.seed)
    accelerator.print(report.format())

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    # A prepared scheduler steps once per process per optimizer step: scale its lengths.
    micro_batches = -(-len(train_data) // (args.per_device_train_batch_size * accelerator.num_processes))  # New Code #
    steps = args.num_train_epochs * optimizer_steps_per_epoch(micro_batches, args.gradient_accumulation_steps)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0,
                              num_training_steps=steps * accelerator.num_processes)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    before, acc_before = evaluate(accelerator, model, eval_dl)  # New Code #
    result = train_loop(accelerator, model, optimizer, train_dl, lr_scheduler=scheduler,
                        num_train_epochs=args.num_train_epochs, max_grad_norm=1.0,
                        loss_fn=classification_loss)  # New Code #
    after, accuracy = evaluate(accelerator, model, eval_dl)  # New Code #
    accelerator.print(f"held-out ({len(eval_data)} images): loss {before:.3f} -> {after:.3f}, accuracy "
                      f"{acc_before:.3f} -> {accuracy:.3f} after {result.optimizer_steps} optimizer steps "
                      f"({result.epochs} epochs); median {result.median_step_seconds:.3f} s/step on "
                      f"{accelerator.num_processes} processes")
    # New Code #
    return {"world_size": accelerator.num_processes, "norm": args.norm, "eval_loss_before": before,
            "eval_loss_after": after, "accuracy_before": acc_before, "accuracy": accuracy,
            "eval_examples": len(eval_data), "train_examples": len(train_data),
            "train_loss": result.train_loss, "optimizer_steps": result.optimizer_steps, "epochs": result.epochs,
            "step_items": result.step_tokens, "verify": report.to_dict(), "exit_code": report.exit_code}


if __name__ == "__main__":
    raise SystemExit(main()["exit_code"])  # New Code #: 1 when the accumulated gradient is not the big batch's
