"""Samples, batches, tokenizers and datasets: the built-in shapes (synthetic.py) or files of your
own (jsonl.py: JSON / JSONL, Parquet, Arrow, WebDataset), chosen by data.dataset; both are a
Dataset (dataset.py).

    batch.py        Sample, Batch, collate: what a row holds and the trainer consumes
    dataset.py      Dataset: rows numbered globally, so the step is the data position
    synthetic.py    the built-in shapes dataset
    jsonl.py        JsonlDataset: a dataset file's records, indexed and packed a window at a time
      windows.py      the order of the windows: blocks of records reordered every epoch
      index_cache.py  where the records lie, kept between runs
      record_files.py one reader per format: .jsonl, .json, .parquet, .arrow, WebDataset .tar
      json_spans.py   where each record lies in a JSON / JSONL file
      records.py      the record schema: one record into Sample parts
      chat.py         the built-in chat template and captions
      bad_samples.py  how bad samples are reported
    mixture.py      MixtureDataset: several sources' rows dealt by weight
    tokenizer.py    the byte tokenizer or a tokenizer.json (tokenizer_classes.py: as transformers)
    hf_processor.py a Hugging Face folder's tokenizer, chat template and image preprocessing
    images.py       image decoding and transformers' image preprocessing
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig
    from titan_vlm.data.batch import SlotData
    from titan_vlm.data.dataset import Dataset, Position
    from titan_vlm.data.hf_processor import HFProcessor
    from titan_vlm.data.image_batch import ImageRule
    from titan_vlm.data.images import NativeResolution
    from titan_vlm.data.index_cache import IndexCache
    from titan_vlm.data.jsonl import IndexShare
    from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer


class ImageGeometry(Protocol):
    """What the data pipeline needs of a family's images (its args provide it, e.g. llava's
    VLMArgs): the side of its native square images, their slots, the ViT's patch size and the
    slot rule of an image of any size."""

    @property
    def image_size(self) -> int: ...

    @property
    def tokens_per_image(self) -> int: ...

    @property
    def patch_size(self) -> int: ...

    def image_tokens(self, height: int, width: int) -> int: ...


def model_inputs(cfg: JobConfig) -> tuple[ByteTokenizer | HFTokenizer, HFProcessor | None]:
    """The tokenizer and (for a model from a Hugging Face folder) the folder's processor: its
    tokenizer, chat template and image preprocessing (data/hf_processor.py).
    model.tokenizer_path, when set, overrides the tokenizer."""
    from titan_vlm.data.hf_processor import HFProcessor
    from titan_vlm.data.tokenizer import build_tokenizer

    processor = HFProcessor.from_folder(cfg.model.hf_path) if cfg.model.hf_path else None
    if processor is not None and not cfg.model.tokenizer_path:
        return processor.tokenizer, processor
    return build_tokenizer(cfg.model.tokenizer_path), processor


def build_dataset(
    cfg: JobConfig,
    args: ImageGeometry,
    tokenizer: ByteTokenizer | HFTokenizer,
    processor: HFProcessor | None = None,
    log_startup: bool = True,
    log_batches: bool = True,
    rule: ImageRule | None = None,
    slot_data: SlotData | None = None,
    share: IndexShare | None = None,
    cache: IndexCache | None = None,
    positions: list[Position] | None = None,
) -> Dataset:
    """The dataset data.dataset names: "synthetic", a dataset file (or files), or "mixture" of
    several (data/mixture.py). Each reads a batch as
    `batch(step, dp_rank, dp_size, local_batch_size)` (rows numbered globally, so the step is the
    data position: data/dataset.py) and carry the counters the metrics report (bad_samples,
    truncated_samples, dropped).
    `processor`: a Hugging Face folder's (`model_inputs`, or the family's ModelSpec.inputs): a
    dataset file's conversations in its chat template and images preprocessed as it says.
    log_startup / log_batches: which warnings this rank logs (JsonlDataset).
    `rule`, `slot_data`: the family's (ModelSpec.data_rule): how its images of their own sizes
    take slots and travel (None: every image at the model's size), its per-slot data. A dataset
    file's images under a rule that is not NativeResolution (a family that sizes its images
    itself) are read through the folder's processor, whose images keep their own sizes.
    `share`: how the job's processes split a file's window passes (data/shared_pass.py);
    `cache`: where a file's record spans are kept between runs (data/index_cache.py);
    `positions`: where a resumed run's data stands, one a dataset file (Dataset.positions: its
    checkpoint's; None: a fresh start)."""
    from titan_vlm.data.bad_samples import BadSampleLog
    from titan_vlm.data.forked import spare_cores
    from titan_vlm.data.images import NativeResolution
    from titan_vlm.data.jsonl import JsonlDataset
    from titan_vlm.data.mixture import MixtureDataset, data_sources
    from titan_vlm.data.synthetic import SyntheticCaptions
    from titan_vlm.errors import ConfigError

    d, t = cfg.data, cfg.training
    if d.dataset == "synthetic" and not d.mixture:
        return SyntheticCaptions(
            args.image_size,
            args.tokens_per_image,
            t.seq_len,
            t.seed,
            d.sentences_per_image,
            d.blank_images,
            d.images_per_sample,
            tokenizer,
            packing=d.packing,
            rule=rule,
            slot_data=slot_data,
        )
    own_sizes = rule is not None and not isinstance(rule, NativeResolution)
    if own_sizes and (processor is None or processor.image_size is not None):
        raise ConfigError(
            f"data.dataset={d.dataset!r}: a dataset file's images for {type(rule).__name__} are "
            "read through model.hf_path's processor: set it to a folder with tokenizer.json and "
            "processor settings (preprocessor_config.json or processor_config.json)"
        )
    sources = data_sources(d.dataset, d.mixture)
    if positions is not None and len(positions) != len(sources):
        raise ConfigError(
            f"data: the checkpoint holds the positions of {len(positions)} dataset file(s), "
            f"the data keys name {len(sources)} (data.dataset / data.mixture changed?)"
        )
    mixed = d.dataset == "mixture"
    bad = BadSampleLog("data.mixture", d.on_bad_sample) if mixed else None
    built = [
        JsonlDataset(
            source,
            tokenizer,
            args.image_size,
            args.tokens_per_image,
            t.seq_len,
            t.seed + k * 1_000_003,  # a mixture's sources each shuffled their own way
            packing=d.packing,
            shuffle=d.shuffle,
            image_root=d.image_root,
            on_bad_sample=d.on_bad_sample,
            max_image_pixels=d.max_image_pixels,
            log_startup=log_startup,
            log_batches=log_batches,
            processor=processor,
            max_frames=d.max_frames,
            rule=rule,
            slot_data=slot_data,
            window=d.index_window,
            share=share,
            cache=cache,
            bad=bad,
            workers=min(d.num_workers, spare_cores()),
            position=positions[k] if positions is not None else None,
        )
        for k, (_, source) in enumerate(sources)  # every rank builds them in this order (share's)
    ]
    if bad is None:
        return built[0]
    return MixtureDataset(built, [w for w, _ in sources], bad)


def native_resolution(cfg: JobConfig, args: ImageGeometry) -> NativeResolution | None:
    """data.native_resolution_pixels' geometry for this model (None: 0, every image at the
    model's size): the ViT's patch size and native side, and the family's image_tokens as the one
    slot rule."""
    from titan_vlm.data.images import NativeResolution

    n = cfg.data.native_resolution_pixels
    if not n:
        return None
    return NativeResolution(n, args.patch_size, args.image_size, args.image_tokens)
