"""Tiny stand-ins for the libraries notebooks train with, for the finder corpus (tests only).

Each class is named and shaped like the real one where the batch finder looks (``TrainingArguments``
is a dataclass with ``per_device_train_batch_size`` and a ``train_batch_size`` property; ``Trainer``
copies it into ``_train_batch_size`` and builds a DataLoader per ``train()`` call; a
``LightningDataModule`` keeps ``batch_size`` and ``hparams``; ``DictConfig`` answers items and
attributes), and small enough to run on a CPU in milliseconds: datasets hold a few random samples,
models are one or two layers. Nothing is downloaded. ``installed()`` puts them in ``sys.modules``
under the real names (transformers, datasets, lightning, pytorch_lightning, accelerate, torchvision,
timm, diffusers, omegaconf) for the duration of a test, and takes them out again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which 1.20 GiB is "
    "free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the allocated memory 76.50 GiB "
    "is allocated by PyTorch, and 300.00 MiB is reserved by PyTorch but unallocated."
)


@contextlib.contextmanager
def out_of_memory_at_first_forward() -> Iterator[None]:
    """Every module call raises a CUDA OOM, as the failed cell did on the GPU, wherever it got to."""

    def hook(module: nn.Module, args: Any) -> None:
        raise torch.OutOfMemoryError(OOM_MESSAGE)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# -- data ---------------------------------------------------------------------------------------------
class _Images(Dataset):
    def __init__(
        self,
        root: str = "data",
        train: bool = True,
        download: bool = False,
        transform: Any = None,
        target_transform: Any = None,
        channels: int = 3,
        size: int = 32,
        classes: int = 10,
        length: int = 48,
    ):
        self.data = torch.randn(length, channels, size, size)
        self.targets = torch.randint(0, classes, (length,)).tolist()
        self.transform = transform
        self.classes = [f"class{i}" for i in range(classes)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.data[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


class CIFAR10(_Images):
    pass


class MNIST(_Images):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, channels=1, size=28, **kwargs)


class FashionMNIST(MNIST):
    pass


class ImageFolder(_Images):
    def __init__(self, root: str, transform: Any = None, **kwargs: Any):
        super().__init__(root, transform=transform, size=64, classes=5)


class FakeData(_Images):
    def __init__(
        self,
        size: int = 48,
        image_size: tuple[int, int, int] = (3, 32, 32),
        num_classes: int = 10,
        transform: Any = None,
        **kwargs: Any,
    ):
        super().__init__(
            transform=transform, channels=image_size[0], size=image_size[1], classes=num_classes, length=size
        )


class _Transform:
    def __init__(self, *args: Any, **kwargs: Any):
        self.transforms = args[0] if args and isinstance(args[0], list) else []

    def __call__(self, x: Any) -> Any:
        return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


class HFDataset:
    """A ``datasets.Dataset``: columns of equal length, mapped, renamed, formatted for torch."""

    def __init__(self, columns: dict[str, list[Any]]):
        self.columns = columns
        self.format: str | None = None

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self.columns[key]
        if isinstance(key, slice):
            return {name: values[key] for name, values in self.columns.items()}
        row = {name: values[key] for name, values in self.columns.items()}
        if self.format == "torch":
            row = {k: torch.as_tensor(v) for k, v in row.items() if not isinstance(v, str)}
        return row

    def map(self, function: Any, batched: bool = False, **kwargs: Any) -> HFDataset:
        if batched:
            extra = function({k: list(v) for k, v in self.columns.items()})
        else:
            rows = [function(self[i]) for i in range(len(self))]
            extra = {k: [row[k] for row in rows] for k in rows[0]} if rows else {}
        return HFDataset({**self.columns, **{k: list(v) for k, v in extra.items()}})

    def remove_columns(self, names: Any) -> HFDataset:
        names = [names] if isinstance(names, str) else names
        return HFDataset({k: v for k, v in self.columns.items() if k not in names})

    def rename_column(self, old: str, new: str) -> HFDataset:
        return HFDataset({(new if k == old else k): v for k, v in self.columns.items()})

    def set_format(self, kind: str) -> None:
        self.format = kind

    def with_format(self, kind: str) -> HFDataset:
        copy = HFDataset(self.columns)
        copy.format = kind
        return copy

    def select(self, indices: Any) -> HFDataset:
        indices = list(indices)
        return HFDataset({k: [v[i] for i in indices] for k, v in self.columns.items()})

    def shuffle(self, seed: int = 0) -> HFDataset:
        return self


class DatasetDict(dict):
    def map(self, function: Any, **kwargs: Any) -> DatasetDict:
        return DatasetDict({k: v.map(function, **kwargs) for k, v in self.items()})

    def remove_columns(self, names: Any) -> DatasetDict:
        return DatasetDict({k: v.remove_columns(names) for k, v in self.items()})

    def rename_column(self, old: str, new: str) -> DatasetDict:
        return DatasetDict({k: v.rename_column(old, new) for k, v in self.items()})

    def set_format(self, kind: str) -> None:
        for value in self.values():
            value.set_format(kind)


def load_dataset(name: str, *args: Any, split: str | None = None, **kwargs: Any) -> Any:
    def part(n: int) -> HFDataset:
        return HFDataset(
            {
                "sentence1": [f"first sentence {i}" for i in range(n)],
                "sentence2": [f"second sentence {i}" for i in range(n)],
                "text": [f"some text number {i}" for i in range(n)],
                "label": [i % 2 for i in range(n)],
                "idx": list(range(n)),
            }
        )

    splits = DatasetDict({"train": part(32), "validation": part(16), "test": part(16)})
    return splits[split] if split else splits


# -- transformers ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainingArguments:
    output_dir: str = "trainer_output"
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    warmup_steps: int = 0
    eval_strategy: str = "no"
    save_strategy: str = "steps"
    logging_steps: int = 500
    report_to: Any = None
    fp16: bool = False
    bf16: bool = False
    seed: int = 42
    push_to_hub: bool = False
    use_cpu: bool = False
    load_best_model_at_end: bool = False

    @property
    def n_gpu(self) -> int:
        return 0

    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size * max(1, self.n_gpu)


@dataclasses.dataclass
class Seq2SeqTrainingArguments(TrainingArguments):
    predict_with_generate: bool = False
    generation_max_length: int | None = None


def _collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in rows[0] if not isinstance(rows[0][k], str)}


class Trainer:
    def __init__(
        self,
        model: Any = None,
        args: TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        tokenizer: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = None,
    ):
        self.model = model
        self.args = args if args is not None else TrainingArguments()
        self.data_collator = data_collator or _collate
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self._train_batch_size = self.args.train_batch_size

    def get_train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_dataset, batch_size=self._train_batch_size, shuffle=True, collate_fn=self.data_collator
        )

    def train(self, resume_from_checkpoint: Any = None) -> Any:
        for batch in self.get_train_dataloader():
            self.model(**batch)
        return None

    def evaluate(self, eval_dataset: Any = None) -> dict[str, float]:
        loader = DataLoader(
            eval_dataset or self.eval_dataset, batch_size=self.args.eval_batch_size, collate_fn=self.data_collator
        )
        for batch in loader:
            self.model(**batch)
        return {}

    def predict(self, test_dataset: Any) -> Any:
        return self.evaluate(test_dataset)


class Seq2SeqTrainer(Trainer):
    pass


@dataclasses.dataclass
class BertConfig:
    vocab_size: int = 100
    hidden_size: int = 16
    num_hidden_layers: int = 1
    num_attention_heads: int = 2
    intermediate_size: int = 32
    num_labels: int = 2


class _Output:
    def __init__(self, logits: torch.Tensor, loss: torch.Tensor | None):
        self.logits = logits
        self.loss = loss

    def __getitem__(self, index: int) -> Any:
        return (self.loss, self.logits)[index]


class TinyTextModel(nn.Module):
    def __init__(self, config: Any = None, num_labels: int = 2):
        super().__init__()
        self.config = config or BertConfig(num_labels=num_labels)
        self.embed = nn.Embedding(1000, 16)
        self.head = nn.Linear(16, num_labels)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: Any = None, labels: Any = None, **kwargs: Any
    ) -> _Output:
        logits = self.head(self.embed(input_ids).mean(1))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return _Output(logits, loss)

    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int = 8, num_return_sequences: int = 1, **kwargs: Any
    ) -> torch.Tensor:
        ids = input_ids.repeat_interleave(num_return_sequences, 0)
        self(ids)
        return ids

    @classmethod
    def from_pretrained(cls, name: str, num_labels: int = 2, **kwargs: Any) -> TinyTextModel:
        return cls(num_labels=num_labels)

    @classmethod
    def from_config(cls, config: Any) -> TinyTextModel:
        return cls(config, getattr(config, "num_labels", 2))


class TinyTokenizer:
    pad_token = "[PAD]"
    eos_token = "</s>"

    def __call__(
        self,
        text: Any,
        *more: Any,
        padding: Any = False,
        truncation: bool = False,
        max_length: int = 12,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        texts = [text] if isinstance(text, str) else list(text)
        ids = [[hash(word) % 1000 for word in t.split()][:max_length] for t in texts]
        ids = [row + [0] * (max_length - len(row)) for row in ids]
        out: dict[str, Any] = {"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}
        if return_tensors == "pt":
            out = {k: torch.tensor(v) for k, v in out.items()}
        return out

    def batch_decode(self, ids: Any, **kwargs: Any) -> list[str]:
        return ["text"] * len(ids)

    @classmethod
    def from_pretrained(cls, name: str, **kwargs: Any) -> TinyTokenizer:
        return cls()


class DataCollatorWithPadding:
    def __init__(self, tokenizer: Any = None, **kwargs: Any):
        self.tokenizer = tokenizer

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return _collate(rows)


# -- Lightning -------------------------------------------------------------------------------------------
class AttributeDict(dict):
    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


def _save_hyperparameters(obj: Any) -> None:
    frame = inspect.currentframe().f_back.f_back  # type: ignore[union-attr]
    arguments = {k: v for k, v in frame.f_locals.items() if k not in ("self", "__class__")}  # type: ignore[union-attr]
    object.__setattr__(obj, "_hparams", AttributeDict(arguments))


class LightningModule(nn.Module):
    @property
    def hparams(self) -> AttributeDict:
        return self.__dict__.setdefault("_hparams", AttributeDict())

    def save_hyperparameters(self, *args: Any, **kwargs: Any) -> None:
        _save_hyperparameters(self)

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass


class LightningDataModule:
    @property
    def hparams(self) -> AttributeDict:
        return self.__dict__.setdefault("_hparams", AttributeDict())

    def save_hyperparameters(self, *args: Any, **kwargs: Any) -> None:
        _save_hyperparameters(self)

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str | None = None) -> None:
        pass


class LightningTrainer:
    def __init__(self, max_epochs: int = 1, accelerator: str = "auto", devices: Any = "auto", **kwargs: Any):
        self.max_epochs = max_epochs
        self.datamodule = None

    def _loader(self, model: Any, loaders: Any, datamodule: Any, hook: str) -> Any:
        if datamodule is None and loaders is not None and isinstance(loaders, LightningDataModule):
            datamodule, loaders = loaders, None
        if datamodule is not None:
            self.datamodule = datamodule
            datamodule.prepare_data()
            datamodule.setup("fit")
            return getattr(datamodule, hook)()
        return loaders if loaders is not None else getattr(model, hook)()

    def fit(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: Any = None,
    ) -> None:
        for index, batch in enumerate(self._loader(model, train_dataloaders, datamodule, "train_dataloader")):
            model.training_step(batch, index)

    def validate(self, model: Any = None, dataloaders: Any = None, datamodule: Any = None) -> None:
        for index, batch in enumerate(self._loader(model, dataloaders, datamodule, "val_dataloader")):
            model.validation_step(batch, index)

    def test(self, model: Any = None, dataloaders: Any = None, datamodule: Any = None) -> None:
        for index, batch in enumerate(self._loader(model, dataloaders, datamodule, "test_dataloader")):
            model.test_step(batch, index)


# -- diffusers -------------------------------------------------------------------------------------------
class UNet2DModel(nn.Module):
    def __init__(self, sample_size: int = 32, in_channels: int = 3, out_channels: int = 3, **kwargs: Any):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)

    def forward(self, sample: torch.Tensor, timestep: Any = None, **kwargs: Any) -> Any:
        return types.SimpleNamespace(sample=self.conv(sample))


class DDPMScheduler:
    def __init__(self, num_train_timesteps: int = 1000, **kwargs: Any):
        self.config = types.SimpleNamespace(num_train_timesteps=num_train_timesteps)

    def add_noise(self, x: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return x + noise


class StableDiffusionPipeline:
    def __init__(self) -> None:
        self.unet = UNet2DModel(in_channels=4, out_channels=4)

    @classmethod
    def from_pretrained(cls, name: str, **kwargs: Any) -> StableDiffusionPipeline:
        return cls()

    def to(self, device: Any) -> StableDiffusionPipeline:
        return self

    def __call__(
        self,
        prompt: Any = None,
        num_inference_steps: int = 50,
        num_images_per_prompt: int = 1,
        guidance_scale: float = 7.5,
        generator: Any = None,
        height: int = 64,
        width: int = 64,
        **kwargs: Any,
    ) -> Any:
        count = (1 if isinstance(prompt, str) else len(prompt)) * num_images_per_prompt
        latents = torch.randn(count, 4, height // 8, width // 8)
        for _ in range(num_inference_steps):
            latents = self.unet(latents).sample
        return types.SimpleNamespace(images=[latents[i] for i in range(count)])


# -- omegaconf -------------------------------------------------------------------------------------------
class DictConfig:
    def __init__(self, content: dict[str, Any]):
        object.__setattr__(
            self, "_content", {k: DictConfig(v) if isinstance(v, dict) else v for k, v in content.items()}
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return self._content[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._content[name] = value

    def __getitem__(self, key: str) -> Any:
        return self._content[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._content[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self._content

    def keys(self) -> Any:
        return self._content.keys()


def _yaml(text: str) -> dict[str, Any]:
    """The nested ``key: value`` subset of YAML that configs in notebooks use."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, root)]
    for line in text.splitlines():
        if not line.strip() or line.strip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        key, _, value = line.strip().partition(":")
        while stack[-1][0] >= indent:
            stack.pop()
        value = value.strip()
        if not value:
            child: dict[str, Any] = {}
            stack[-1][1][key] = child
            stack.append((indent, child))
        else:
            try:
                stack[-1][1][key] = int(value)
            except ValueError:
                try:
                    stack[-1][1][key] = float(value)
                except ValueError:
                    stack[-1][1][key] = value.strip("'\"")
    return root


class OmegaConf:
    @staticmethod
    def create(content: Any = None) -> DictConfig:
        return DictConfig(_yaml(content) if isinstance(content, str) else dict(content or {}))

    @staticmethod
    def to_yaml(config: DictConfig) -> str:
        return repr(config._content)


# -- models ----------------------------------------------------------------------------------------------
class TinyCNN(nn.Module):
    def __init__(self, num_classes: int = 10, in_chans: int = 3, **kwargs: Any):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_chans, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))


def _tiny_cnn(weights: Any = None, num_classes: int = 10, **kwargs: Any) -> TinyCNN:
    return TinyCNN(num_classes)


def create_model(name: str, pretrained: bool = False, num_classes: int = 1000, **kwargs: Any) -> TinyCNN:
    return TinyCNN(num_classes)


# -- tqdm -------------------------------------------------------------------------------------------------
class tqdm:
    def __init__(self, iterable: Any = None, total: Any = None, desc: Any = None, **kwargs: Any):
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass


# -- accelerate ---------------------------------------------------------------------------------------------
class Accelerator:
    """``accelerate.Accelerator`` on one process: ``prepare`` hands back what it is given."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.device = torch.device("cpu")

    def prepare(self, *objects: Any) -> Any:
        return objects[0] if len(objects) == 1 else objects

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward()


# -- the modules -------------------------------------------------------------------------------------------
def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # importlib.util.find_spec asks for one
    module.__dict__.update(attributes)
    return module


def modules() -> dict[str, types.ModuleType]:
    datasets_tv = _module(
        "torchvision.datasets",
        CIFAR10=CIFAR10,
        MNIST=MNIST,
        FashionMNIST=FashionMNIST,
        ImageFolder=ImageFolder,
        FakeData=FakeData,
    )
    transforms = _module(
        "torchvision.transforms",
        **{
            n: type(n, (_Transform,), {})
            for n in (
                "Compose",
                "ToTensor",
                "Normalize",
                "Resize",
                "RandomCrop",
                "RandomHorizontalFlip",
                "CenterCrop",
                "RandomResizedCrop",
                "Lambda",
            )
        },
    )
    models = _module(
        "torchvision.models",
        resnet18=_tiny_cnn,
        resnet50=_tiny_cnn,
        mobilenet_v3_small=_tiny_cnn,
        ResNet50_Weights=types.SimpleNamespace(DEFAULT=None),
    )
    torchvision = _module("torchvision", datasets=datasets_tv, transforms=transforms, models=models)
    auto = dict(
        AutoTokenizer=TinyTokenizer,
        AutoModelForSequenceClassification=TinyTextModel,
        AutoModelForCausalLM=TinyTextModel,
        AutoModelForSeq2SeqLM=TinyTextModel,
        AutoModel=TinyTextModel,
        BertForSequenceClassification=TinyTextModel,
    )
    transformers = _module(
        "transformers",
        TrainingArguments=TrainingArguments,
        Trainer=Trainer,
        Seq2SeqTrainingArguments=Seq2SeqTrainingArguments,
        Seq2SeqTrainer=Seq2SeqTrainer,
        BertConfig=BertConfig,
        DataCollatorWithPadding=DataCollatorWithPadding,
        get_scheduler=lambda *a, **k: None,
        **auto,
    )
    lightning_pytorch = _module(
        "lightning.pytorch",
        LightningModule=LightningModule,
        LightningDataModule=LightningDataModule,
        Trainer=LightningTrainer,
    )
    lightning = _module(
        "lightning",
        LightningModule=LightningModule,
        LightningDataModule=LightningDataModule,
        Trainer=LightningTrainer,
        pytorch=lightning_pytorch,
    )
    pytorch_lightning = _module(
        "pytorch_lightning",
        LightningModule=LightningModule,
        LightningDataModule=LightningDataModule,
        Trainer=LightningTrainer,
    )
    timm_data = _module(
        "timm.data", resolve_data_config=lambda *a, **k: {}, create_transform=lambda *a, **k: _Transform()
    )
    timm = _module("timm", create_model=create_model, data=timm_data)
    diffusers = _module(
        "diffusers",
        StableDiffusionPipeline=StableDiffusionPipeline,
        DiffusionPipeline=StableDiffusionPipeline,
        UNet2DModel=UNet2DModel,
        DDPMScheduler=DDPMScheduler,
    )
    omegaconf = _module("omegaconf", OmegaConf=OmegaConf, DictConfig=DictConfig)
    datasets = _module("datasets", load_dataset=load_dataset, Dataset=HFDataset, DatasetDict=DatasetDict)
    accelerate = _module("accelerate", Accelerator=Accelerator)
    tqdm_auto = _module("tqdm.auto", tqdm=tqdm)
    tqdm_module = _module("tqdm", tqdm=tqdm, trange=lambda *a, **k: tqdm(range(*a)), auto=tqdm_auto)
    return {
        "tqdm": tqdm_module,
        "tqdm.auto": tqdm_auto,
        "torchvision": torchvision,
        "torchvision.datasets": datasets_tv,
        "torchvision.transforms": transforms,
        "torchvision.models": models,
        "transformers": transformers,
        "lightning": lightning,
        "lightning.pytorch": lightning_pytorch,
        "pytorch_lightning": pytorch_lightning,
        "timm": timm,
        "timm.data": timm_data,
        "diffusers": diffusers,
        "omegaconf": omegaconf,
        "datasets": datasets,
        "accelerate": accelerate,
    }


# Libraries whose real objects the finder must know, used for real by ``installed(real=True)`` where they
# are installed (with tqdm, which they import themselves).
REAL_LIBRARIES = ("transformers", "accelerate", "lightning", "pytorch_lightning")


def real_libraries() -> tuple[str, ...]:
    """The real libraries installed here (the GPU machine has them; CI installs them with the ``real`` extra)."""
    return tuple(name for name in REAL_LIBRARIES if importlib.util.find_spec(name) is not None)


@contextlib.contextmanager
def installed(real: bool = False) -> Iterator[None]:
    """The stand-ins importable under the real libraries' names, and the real ones (if any) put back after.

    With ``real``, transformers, accelerate and Lightning are the real libraries where installed, and
    only what would download from the Hugging Face Hub is replaced: ``AutoTokenizer`` and the
    ``AutoModelFor...`` classes build a real tokenizer and real models from tiny configs (``_hub_free``).
    """
    replaced = modules()
    if real:
        using = {name for name in real_libraries()} | ({"tqdm"} if importlib.util.find_spec("tqdm") else set())
        replaced = {name: module for name, module in replaced.items() if name.split(".")[0] not in using}
    if real:
        _preload(real_libraries())
    saved = {name: sys.modules.get(name) for name in replaced}
    sys.modules.update(replaced)
    with contextlib.ExitStack() as stack:
        if real and "transformers" not in replaced and importlib.util.find_spec("transformers") is not None:
            stack.enter_context(_hub_free())
        try:
            yield
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


# What the corpus takes from the real libraries: imported before the stand-ins are in ``sys.modules``, so
# the libraries' own checks for torchvision (and what they import lazily) never meet a stand-in.
_PRELOADED = {
    "transformers": (
        "Trainer", "TrainingArguments", "Seq2SeqTrainer", "Seq2SeqTrainingArguments", "DataCollatorWithPadding",
        "BertConfig", "BertForSequenceClassification", "GPT2Config", "GPT2LMHeadModel", "T5Config",
        "T5ForConditionalGeneration", "PreTrainedTokenizerFast", "get_scheduler", "AutoModelForSequenceClassification",
    ),
    "accelerate": ("Accelerator",),
    "lightning": ("Trainer", "LightningModule", "LightningDataModule", "pytorch"),
    "pytorch_lightning": ("Trainer", "LightningModule", "LightningDataModule"),
}


def _preload(names: Iterator[str] | tuple[str, ...]) -> None:
    for name in names:
        module = importlib.import_module(name)
        for attribute in _PRELOADED.get(name, ()):
            getattr(module, attribute)


# -- the real transformers, without the Hub ----------------------------------------------------------------
_WORDS = (
    "first second sentence some text number review was fine once upon a time the of and to in is it "
    + " ".join(str(i) for i in range(100))
).split()
_VOCABULARY = 160


def tiny_tokenizer() -> Any:
    """A real ``PreTrainedTokenizerFast`` over a small word-level vocabulary, built in memory."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "</s>"]
    vocabulary = {word: index for index, word in enumerate(dict.fromkeys(specials + _WORDS))}
    assert len(vocabulary) <= _VOCABULARY
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        eos_token="</s>",
        model_max_length=64,
        model_input_names=["input_ids", "attention_mask"],
    )


@contextlib.contextmanager
def _hub_free() -> Iterator[None]:
    """transformers' Hub loaders replaced by builders of tiny real models and a real tokenizer; put back after."""
    import transformers

    def classifier(name: str = "", num_labels: int = 2, **kwargs: Any) -> Any:
        config = transformers.BertConfig(
            vocab_size=_VOCABULARY, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=64, num_labels=num_labels,
        )
        return transformers.BertForSequenceClassification(config)

    def causal(name: str = "", **kwargs: Any) -> Any:
        config = transformers.GPT2Config(vocab_size=_VOCABULARY, n_positions=256, n_embd=16, n_layer=1, n_head=2,
                                         eos_token_id=4, pad_token_id=0)
        return transformers.GPT2LMHeadModel(config)

    def seq2seq(name: str = "", **kwargs: Any) -> Any:
        config = transformers.T5Config(vocab_size=_VOCABULARY, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                       num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=4)
        return transformers.T5ForConditionalGeneration(config)

    original_auto = transformers.AutoModelForSequenceClassification
    loaders = {
        "AutoTokenizer": type("AutoTokenizer", (), {"from_pretrained": staticmethod(lambda *a, **k: tiny_tokenizer())}),
        "AutoModelForSequenceClassification": type(
            "AutoModelForSequenceClassification",
            (),
            {"from_pretrained": staticmethod(classifier), "from_config": staticmethod(original_auto.from_config)},
        ),
        "AutoModelForCausalLM": type("AutoModelForCausalLM", (), {"from_pretrained": staticmethod(causal)}),
        "AutoModelForSeq2SeqLM": type("AutoModelForSeq2SeqLM", (), {"from_pretrained": staticmethod(seq2seq)}),
    }
    saved = {name: getattr(transformers, name) for name in loaders}
    for name, loader in loaders.items():
        setattr(transformers, name, loader)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(transformers, name, value)
