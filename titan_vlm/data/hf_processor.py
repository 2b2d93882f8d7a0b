"""What a Hugging Face model folder says about its inputs: the tokenizer, the chat template and
the image preprocessing, each computing what transformers' processor (LlavaProcessor with a
CLIPImageProcessor or SiglipImageProcessor) computes on the same folder.

The tokenizer and chat-template half is shared by every family; the image half is pluggable
(`FolderVision`): LLaVA's (`LlavaVision`, every image at the folder's fixed size, a video as its
frames, each one image) is `HFProcessor.from_folder`'s; another family builds an HFProcessor with
its own (`HFProcessor.with_vision`: e.g. models/common/qwen_vl/processor.py `chat_processor`, images
at their own sizes and a video as one part at its `<|video_pad|>` token).

    proc = HFProcessor.from_folder("llava-1.5-7b-hf")
    proc.encode("USER: <image>\\nWhat is this? ASSISTANT:")   # input ids, one <image> per image
    proc.prompt_parts("USER: <image>\\nWhat is this? ASSISTANT:", [proc.preprocess_image(path)])
    chat_prompt(proc, "What is this?", [image])               # the chat template's question
    proc.conversation_parts(turns, images)                     # a training sample, loss on answers

Sample parts (data/batch.py) hold one image as one part; `input_ids(parts, n)` writes each image
as n image tokens, as the processor's input_ids do (n: the model's tokens per image). Where the
image half reads videos whole, a video is one part too (data/images.py VideoRef before decoding,
[T, 3, H, W] after), cut at the video token.

Files read (a folder as `save_pretrained` writes it; a missing one is a one-line ConfigError
naming the folder and file): tokenizer.json and tokenizer_config.json (special_tokens_map.json
where present: data/tokenizer.py); the image processor settings from processor_config.json's
"image_processor" (transformers 5) or preprocessor_config.json; config.json for the image token
id (`image_token_index` or `image_token_id`, checked against the tokenizer) and the model's input
size (`vision_config.image_size`, checked against the image processor's output size). The chat
template, where the folder has one, as transformers' processor picks it: processor_config.json's
"chat_template", else chat_template.json, else chat_template.jinja; else tokenizer_config.json's
"chat_template" (a named list: the "default" one), which transformers' processor does not read
but its tokenizer's apply_chat_template does, and then as that one tokenizes: without adding
special tokens (the processor adds them unless the rendering starts with the BOS string).

Image preprocessing is transformers' PIL backend (data/images.py ImageProcessing), which is what
transformers 5 runs where torchvision is not installed (it then warns that CLIPImageProcessor
"falls back to CLIPImageProcessorPil"); with torchvision, transformers 5 resizes with torchvision
instead, whose numbers differ from Pillow's by up to a few 1e-2.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from titan_vlm.data.batch import ImageBytes, Part, Prompt, VideoFrames, is_image
from titan_vlm.data.chat import PLACEHOLDER
from titan_vlm.data.images import (
    DEFAULT_FPS,
    ImageProcessing,
    ImageTooLarge,
    VideoRef,
    open_image,
)
from titan_vlm.data.tokenizer import HFTokenizer
from titan_vlm.data.video import decode_video, probe_video
from titan_vlm.errors import ConfigError
from titan_vlm.files import read_json, read_text

if TYPE_CHECKING:
    import jinja2
    import jinja2.nodes
    import jinja2.parser
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from PIL import Image as PILImage

KEY = "model.hf_path"

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# transformers' class defaults for the settings a preprocessor file may leave out
IMAGE_PROCESSORS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": {
        "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224},
        "do_center_crop": True,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
    },
    "SiglipImageProcessor": {
        "size": {"height": 224, "width": 224},
        "do_center_crop": False,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
    },
}
COMMON_DEFAULTS = {
    "do_convert_rgb": True,
    "do_resize": True,
    "resample": 3,  # bicubic
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
}


VIDEO = "<video>"  # where a record's video goes (data/records.py), a {"type": "video"} item


class ChatError(ValueError):
    """A conversation this folder's chat template cannot turn into a sample (a bad record)."""


class FolderVision(ABC):
    """The image half of a folder's processor, one per family: how an image (and, for a family
    that reads videos whole, a video's frames) becomes the pixels its model takes.

    `image_size`: every image's side where the processor fixes it (LLaVA), None where images keep
    their own sizes (the family's ImageRule.fit sizes them from their headers and the pixels are
    made at that size). `tokens_per_image`: what the settings imply, None where they do not say.
    `video_token` / `video_token_id`: the token the chat template writes for a {"type": "video"}
    item, where the family reads a video whole (one part, [T, 3, H, W] pixels); None: a video is
    its frames, each one image. `splits_videos`: the processor writes text between a video's
    frame groups (`split_videos`), so a video is one part per frame group, and only a chat
    template's rendering (not a caption) can hold one."""

    image_size: int | None = None
    tokens_per_image: int | None = None
    video_token: str | None = None
    video_token_id: int | None = None
    splits_videos: ClassVar[bool] = False

    @abstractmethod
    def image(self, image: PILImage.Image, size: tuple[int, int] | None) -> torch.Tensor:
        """One opened image as pixels [3, H, W] float32; `size`: the (H, W) to make it (None:
        the processor's own choice)."""

    def video(self, frames: list[PILImage.Image], size: tuple[int, int] | None) -> torch.Tensor:
        """A video's opened frames (one size) as pixels [T, 3, H, W] float32, each frame at
        `size` (None: the processor's choice for the frames' size)."""
        raise ValueError("this model folder's processor reads a video as its frames")

    def video_indices(self, frames: int, fps: float) -> list[int]:
        """Which frames of a video file of `frames` frames at `fps` (its header) the processor
        keeps; ValueError where it keeps none."""
        raise ValueError("this model folder's processor reads a video as its frames")

    def split_videos(self, text: str, videos: list[Part]) -> tuple[list[Edit], list[Part]]:
        """Where the processor writes text inside a video (`splits_videos`; Qwen3-VL: each frame
        group's timestamp, and its own vision start / end tokens): the edits that make the
        rendered `text` what the processor tokenizes, each video token's place then holding
        one of the returned parts (each video's frame groups, in order). ChatError where the
        video tokens are not one per video."""
        raise NotImplementedError(f"{type(self).__name__} keeps each video one part")


# One edit of a rendered chat: the characters [start, end) replaced by the text.
Edit = tuple[int, int, str]


def apply_edits(
    text: str, edits: list[Edit], trained: list[tuple[int, int]]
) -> tuple[str, list[tuple[int, int]]]:
    """`text` with `edits` (in order, none overlapping) made, and the `trained` character spans
    moved with it. ChatError where an edit falls inside a trained span (a video inside an
    assistant turn)."""
    pieces: list[str] = []
    shifts: list[tuple[int, int]] = []  # (old end of an edit, total shift after it)
    at, shift = 0, 0
    for start, end, new in edits:
        if any(s < end and start < e for s, e in trained):
            raise ChatError("a video inside an assistant turn")
        pieces += [text[at:start], new]
        at = end
        shift += len(new) - (end - start)
        shifts.append((end, shift))

    def moved(pos: int) -> int:  # by the shift of the edits that end at or before it
        return pos + next((d for end, d in reversed(shifts) if end <= pos), 0)

    pieces.append(text[at:])
    return "".join(pieces), [(moved(s), moved(e)) for s, e in trained]


@dataclass(frozen=True)
class LlavaVision(FolderVision):
    """A LLaVA folder's image half: transformers' CLIP / SigLIP image processor (data/images.py
    ImageProcessing) makes every image `image_size` square (the model's input size, config.json
    vision_config.image_size). `tokens_per_image`: what the folder's processor settings imply
    (patch_size, num_additional_image_tokens, vision_feature_select_strategy), None where they
    do not say; the model decides."""

    processing: ImageProcessing
    image_size: int
    tokens_per_image: int | None

    def image(self, image: PILImage.Image, size: tuple[int, int] | None) -> torch.Tensor:
        return self.processing(image)


@dataclass
class HFProcessor:
    """A model folder's input side (see the module docstring): the shared tokenizer and chat
    template, and the family's image half `vision`."""

    folder: str
    tokenizer: HFTokenizer
    image_token: str
    image_token_id: int
    chat_template: str | None
    template_file: str  # where the chat template came from, for errors
    template_is_tokenizers: bool  # from tokenizer_config.json (see the module docstring)
    vision: FolderVision

    @property
    def image_size(self) -> int | None:
        """Every image's side where the processor fixes it (LLaVA's: config.json
        vision_config.image_size), None where images keep their own sizes."""
        return self.vision.image_size

    @property
    def tokens_per_image(self) -> int | None:
        return self.vision.tokens_per_image

    @property
    def image_processing(self) -> ImageProcessing:
        """A LLaVA folder's image processor settings."""
        if not isinstance(self.vision, LlavaVision):
            raise AttributeError(f"{self.folder}: not a LLaVA folder's image processor")
        return self.vision.processing

    @property
    def video_token_id(self) -> int | None:
        """The video token's id where a video is one part (FolderVision), else None."""
        return self.vision.video_token_id

    @classmethod
    def with_vision(
        cls,
        path: str | Path,
        processor: dict,
        tokenizer: HFTokenizer,
        image_token: str,
        vision: FolderVision,
    ) -> HFProcessor:
        """A folder's processor with the image half `vision`: its chat template (found as the
        module docstring says; `processor`: its processor_config.json, or {}), `tokenizer`
        (HFTokenizer.from_folder with `image_token`, whose id is its IMAGE)."""
        template, template_file = _chat_template(Path(path), processor)
        if template is not None:
            _compiled(template, template_file)  # a syntax error is the file's, not a sample's
        return cls(
            folder=str(path),
            tokenizer=tokenizer,
            image_token=image_token,
            image_token_id=tokenizer.IMAGE,
            chat_template=template,
            template_file=template_file,
            template_is_tokenizers=template_file.endswith("tokenizer_config.json"),
            vision=vision,
        )

    @classmethod
    def from_folder(cls, path: str) -> HFProcessor:
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError(f"{KEY}: folder not found: {path}")
        config = read_json(folder / "config.json", KEY)
        processor: dict = {}
        if (folder / "processor_config.json").is_file():
            processor = read_json(folder / "processor_config.json", KEY)
        if isinstance(processor.get("image_processor"), dict):
            settings, settings_file = processor["image_processor"], "processor_config.json"
        elif (folder / "preprocessor_config.json").is_file():
            settings = read_json(folder / "preprocessor_config.json", KEY)
            settings_file = "preprocessor_config.json"
        else:
            raise ConfigError(
                f"{KEY}: {path}: no image processor settings (preprocessor_config.json, or "
                "processor_config.json with an 'image_processor' entry)"
            )
        image_token = processor.get("image_token", PLACEHOLDER)
        tokenizer = HFTokenizer.from_folder(folder, image_token)
        image_token_id = tokenizer.IMAGE
        for key in ("image_token_index", "image_token_id"):
            if key in config and config[key] != image_token_id:
                raise ConfigError(
                    f"{KEY}: {path}/config.json: {key}={config[key]} but the tokenizer's "
                    f"{image_token!r} is id {image_token_id}"
                )
        where = f"{path}/{settings_file}"
        processing = image_processing(settings, where)
        image_size = config.get("vision_config", config).get("image_size")
        if not isinstance(image_size, int):
            raise ConfigError(f"{KEY}: {path}/config.json: no vision_config.image_size")
        if processing.output_size != (image_size, image_size):
            raise ConfigError(
                f"{KEY}: {where}: the image processor makes images of "
                f"{_describe_size(processing)}, config.json's vision_config.image_size is "
                f"{image_size}"
            )
        vision = LlavaVision(processing, image_size, _tokens_per_image(processor, image_size))
        return cls.with_vision(path, processor, tokenizer, image_token, vision)

    # -- text ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text` as the folder's tokenizer encodes it (transformers' tokenizer(text))."""
        return self.tokenizer.encode_text(text, add_special_tokens)

    def prompt_parts(self, text: str, images: list[Part]) -> list[Part]:
        """A raw prompt as LlavaProcessor(text=..., images=...) reads it: tokenized by the
        folder's tokenizer with its special tokens (e.g. BOS), each `<image>` (the image token)
        the next of `images`. All context (Prompt parts)."""
        return self._parts(text, images, add_special_tokens=True, trained=[])

    def input_ids(self, parts: list[Part], tokens_per_image: int) -> list[int]:
        """The processor's input_ids for Sample parts: each image as `tokens_per_image` image
        tokens."""
        ids: list[int] = []
        for part in parts:
            ids += [self.image_token_id] * tokens_per_image if is_image(part) else list(part)
        return ids

    # -- chat template ---------------------------------------------------------------------

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The chat template applied as transformers' apply_chat_template(tokenize=False) applies
        it: same jinja2 environment and globals, the tokenizer's special token strings."""
        if self.chat_template is None:
            raise ConfigError(
                f"{KEY}: {self.folder} has no chat template (chat_template.jinja, "
                "chat_template.json or tokenizer_config.json's 'chat_template')"
            )
        import jinja2

        try:
            return _compiled(self.chat_template, self.template_file).render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.tokenizer.special_tokens,
            )
        except (jinja2.TemplateError, TypeError) as e:  # raise_exception, undefined, bad types
            raise ChatError(f"{self.template_file}: {type(e).__name__}: {e}") from None

    def add_special_tokens(self, rendered: str) -> bool:
        """Whether transformers adds the tokenizer's special tokens to a rendered chat: the
        processor does unless it starts with the BOS string; the tokenizer's apply_chat_template
        (a template from tokenizer_config.json) never does."""
        bos = self.tokenizer.special_tokens.get("bos_token")
        return not (self.template_is_tokenizers or (bos and rendered.startswith(bos)))

    def chat_parts(self, messages: list[dict], images: list[Part]) -> list[Part]:
        """`messages` (HF chat format) rendered with the generation prompt and tokenized as
        processor.apply_chat_template(..., add_generation_prompt=True, tokenize=True) does; all
        context. `images` fill the {"type": "image"} items in order."""
        text = self.render(messages, add_generation_prompt=True)
        return self._parts(text, images, self.add_special_tokens(text), trained=[])

    @property
    def reads_videos(self) -> bool:
        """Whether a video is one part at the video token (else its frames, each one image)."""
        return self.vision.video_token_id is not None

    def conversation_parts(self, turns: list[tuple[bool, str]], images: list[Part]) -> list[Part]:
        """A LLaVA conversation (turns: (from the user?, text with `<image>` placeholders, and
        `<video>` ones where the folder reads videos whole), alternating from the user) as a
        training sample in the folder's chat template: the ids
        of the whole rendering (as apply_chat_template gives them), trained (plain lists) where a
        token lies entirely inside an assistant turn's span, context (Prompt) elsewhere.

        The span of assistant message i is what rendering messages[:i + 1] adds to rendering
        messages[:i] with the generation prompt: the answer and whatever the template writes
        after it (an end token such as </s> or <|im_end|>\\n). The renderings must be prefixes of
        each other and of the whole; a template for which they are not (one that rewrites
        earlier turns) is a ConfigError naming its file. A token that straddles a span's edge
        (e.g. a byte-level " USER" whose space ends the answer) is context."""
        messages = [_message(from_user, text, self.reads_videos) for from_user, text in turns]
        full = self.render(messages, add_generation_prompt=False)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            after = self.render(messages[: i + 1], add_generation_prompt=False)
            start = spans[-1][1] if spans else 0
            if not (after.startswith(before) and full.startswith(after) and len(before) >= start):
                raise ConfigError(
                    f"{KEY}: {self.template_file}: the chat template is not prefix-stable: the "
                    f"rendering of the first {i} message(s) with the generation prompt and of the "
                    f"first {i + 1} are not prefixes of the whole conversation's, so the answers "
                    "cannot be told from the context"
                )
            spans.append((len(before), len(after)))
        return self._parts(full, images, self.add_special_tokens(full), spans)

    def _parts(
        self,
        text: str,
        images: list[Part],
        add_special_tokens: bool,
        trained: list[tuple[int, int]],
    ) -> list[Part]:
        """`text` tokenized whole, cut into parts: each image token becomes the next image (of
        `images`, the videos left out), each video token the next video (or, where the vision
        half splits videos, `FolderVision.split_videos`, the next frame group, the text it
        writes tokenized with the rest), tokens inside a `trained` character span plain lists,
        the rest Prompt."""
        videos = [p for p in images if is_video(p)]
        if videos and self.vision.splits_videos:  # each frame group, with text between them
            edits, videos = self.vision.split_videos(text, videos)
            text, trained = apply_edits(text, edits, trained)
        enc = self.tokenizer.tok.encode(text, add_special_tokens=add_special_tokens)
        queues: dict[int, list[Part]] = {
            self.image_token_id: [p for p in images if not is_video(p)],
        }
        if self.vision.video_token_id is not None:
            queues[self.vision.video_token_id] = videos
        elif videos:
            raise ChatError("a video part, and the folder's processor reads videos as frames")
        for token_id, queue in queues.items():
            count = enc.ids.count(token_id)
            if count != len(queue):
                kind, name = (
                    ("image", self.image_token)
                    if token_id == self.image_token_id
                    else ("video", str(self.vision.video_token))
                )
                raise ChatError(f"{count} {kind} token(s) {name!r} for {len(queue)} {kind}(s)")
        parts: list[Part] = []
        run: list[int] = []
        run_trained = False

        def flush() -> None:
            if run:
                parts.append(list(run) if run_trained else Prompt(run))
                run.clear()

        for token, (start, end) in zip(enc.ids, enc.offsets):
            if token in queues:
                if any(s <= start < e for s, e in trained):
                    raise ChatError("an image inside an assistant turn")
                flush()
                parts.append(queues[token].pop(0))
                continue
            is_trained = any(s <= start and end <= e for s, e in trained)
            if is_trained != run_trained:
                flush()
                run_trained = is_trained
            run.append(token)
        flush()
        return parts

    # -- images ----------------------------------------------------------------------------

    def preprocess_image(
        self,
        image: str | Path | ImageBytes | PILImage.Image,
        max_pixels: int | None = None,
        size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """An image file (path) or PIL image as the folder's image processor's pixel_values:
        float32 [3, image_size, image_size] (LLaVA), or [3, H, W] at `size` (a family whose
        images keep their own sizes; None: the processor's choice). `max_pixels`: as
        data/images.py open_image."""
        if isinstance(image, (str, Path, ImageBytes)):
            with open_image(image, max_pixels) as img:
                return self.vision.image(img, size)
        return self.vision.image(image, size)

    def preprocess_video(
        self,
        frames: Sequence[str | Path],
        max_pixels: int | None = None,
        size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """A video's frame files (one size: else ValueError) as pixels [T, 3, H, W] float32,
        each frame at `size` (None: the processor's choice), where the folder reads videos
        whole (else ValueError). `max_pixels`: each frame's, as data/images.py open_image."""
        if not frames:
            raise ValueError("a video of no frames")
        with ExitStack() as stack:
            images = [stack.enter_context(open_image(f, max_pixels)) for f in frames]
            for path, img in zip(frames, images):
                if img.size != images[0].size:
                    raise ValueError(
                        f"a video's frames must share one size: {path} is "
                        f"{img.size[0]}x{img.size[1]}, its first frame "
                        f"{images[0].size[0]}x{images[0].size[1]}"
                    )
            return self.vision.video(images, size)

    def preprocess_video_ref(self, ref: VideoRef, max_pixels: int | None = None) -> VideoFrames:
        """A video's kept frames (`ref`: a file's from video_file_frames, decoded; frame files'
        from kept_frame_files, opened) made the pixels the folder's processor makes (as
        `preprocess_video`, at ref.frame_size: None, the processor's choice), with the rate
        they were sampled at and their times. VideoError (data/video.py) where a file cannot be
        decoded; Pillow's errors and ImageTooLarge (`max_pixels`) for frame files."""
        from PIL import Image

        assert ref.fps is not None, "a video whose frames were not chosen"
        if ref.is_file:
            frames = [Image.fromarray(frame) for frame in decode_video(ref.path, ref.indices)]
            pixels = self.vision.video(frames, ref.frame_size)
        else:
            pixels = self.preprocess_video(ref.frames, max_pixels, ref.frame_size)
        return VideoFrames(pixels, ref.fps, ref.times())


def kept_frame_files(processor: HFProcessor, frames: Sequence[Path]) -> VideoRef:
    """A video given as frame files, as the folder's processor keeps them: its frame sampling
    (FolderVision.video_indices) applied to them as to a video of that many frames at
    DEFAULT_FPS (what transformers assumes of frames given without metadata: Qwen2-VL's
    processor keeps every one by default, Qwen3-VL's 2 a second), their indices among the files,
    the rate they were kept at and DEFAULT_FPS as their rate (frame_size not yet chosen).
    ValueError where the sampling keeps none."""
    indices, fps = kept_frames(processor, len(frames), DEFAULT_FPS)
    kept = tuple(Path(frames[i]) for i in indices)
    return VideoRef(kept[0], frames=kept, indices=indices, fps=fps, rate=DEFAULT_FPS)


def kept_frames(processor: HFProcessor, total: int, rate: float) -> tuple[tuple[int, ...], float]:
    """The frames of a video of `total` frames at `rate` frames per second the folder's
    processor keeps (FolderVision.video_indices), and the rate they were kept at (kept / total x
    rate: transformers' sampled_fps)."""
    indices = tuple(processor.vision.video_indices(total, rate))
    return indices, len(indices) / total * rate


def video_file_frames(
    processor: HFProcessor, path: Path, max_pixels: int | None
) -> tuple[VideoRef, tuple[int, int]]:
    """A video file's header read for its sample (data/video.py probe_video): its VideoRef
    (the frames the folder's processor keeps, the rate they were sampled at: kept / total x the
    stream's rate, transformers' sampled_fps; the stream's rate; frame_size not yet chosen) and
    the frames' (height, width). VideoError (data/video.py) for a file that cannot be read,
    ImageTooLarge for frames of more than `max_pixels` pixels, ValueError where the processor
    keeps no frame."""
    info = probe_video(path)
    if max_pixels is not None and info.height * info.width > max_pixels:
        raise ImageTooLarge(f"{info.width}x{info.height} frames > {max_pixels} pixels")
    indices, fps = kept_frames(processor, info.frames, info.fps)
    ref = VideoRef(path, indices=indices, fps=fps, rate=info.fps)
    return ref, (info.height, info.width)


def is_video(part: Part) -> bool:
    """Whether a part is one video: a VideoRef before decoding, [T, 3, H, W] pixels or
    VideoFrames after."""
    return isinstance(part, (VideoRef, VideoFrames)) or (
        isinstance(part, torch.Tensor) and part.ndim == 4
    )


def chat_prompt(processor: HFProcessor, question: str, images: list[Part]) -> list[Part]:
    """A one-turn question about images (and a video, where the folder reads videos whole) in
    the folder's chat template, ending with the generation prompt (what follows is the answer):
    Sample parts, all context. The images come first in the turn, in order, then the video,
    then the question, as a message [image..., video, text] that apply_chat_template renders."""
    marks = "".join(VIDEO if is_video(p) else PLACEHOLDER for p in images)
    message = _message(True, f"{marks}{question}", processor.reads_videos)
    return processor.chat_parts([message], images)


def _message(from_user: bool, text: str, videos: bool = False) -> dict:
    """One LLaVA turn as an HF chat message. A user turn's content: each `<image>` placeholder
    a {"type": "image"} item (with `videos`, each `<video>` a {"type": "video"} item), the text
    between them (stripped of the whitespace around the placeholders, e.g. LLaVA's "<image>\\n")
    {"type": "text"} items; the template decides where images and separators go. An assistant
    turn: one text item."""
    marks = [PLACEHOLDER, VIDEO] if videos else [PLACEHOLDER]
    if not from_user:
        for mark in marks:
            if mark in text:
                raise ChatError(f"an {mark} placeholder in an assistant turn")
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}
    content: list[dict] = []
    pieces = re.split("(" + "|".join(re.escape(m) for m in marks) + ")", text)
    for i, piece in enumerate(pieces):
        if i % 2:
            content.append({"type": "image" if piece == PLACEHOLDER else "video"})
        elif piece.strip():
            content.append({"type": "text", "text": piece.strip()})
    return {"role": "user", "content": content}


def _describe_size(p: ImageProcessing) -> str:
    if p.output_size is None:
        return f"the image's aspect ratio (shortest edge {p.shortest_edge}, no center crop)"
    return f"{p.output_size[0]}x{p.output_size[1]} pixels"


def _size(value: Any, what: str, where: str, square: bool) -> dict:
    """A size setting as transformers normalises it: an int is a shortest edge (or, for
    crop_size, a square), a dict is kept."""
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, dict):
        return value
    raise ConfigError(f"{KEY}: {where}: {what} must be an int or a dict, got {value!r}")


def _triple(value: Any, what: str, where: str) -> tuple[float, float, float]:
    values = [value] * 3 if isinstance(value, (int, float)) else value
    if not (isinstance(values, (list, tuple)) and len(values) == 3):
        raise ConfigError(f"{KEY}: {where}: {what} must be one number or three, got {value!r}")
    return tuple(float(v) for v in values)  # type: ignore[return-value]


def image_processing(settings: dict, where: str) -> ImageProcessing:
    """A preprocessor file's settings (CLIPImageProcessor or SiglipImageProcessor, with
    transformers' class defaults for what it leaves out) as data/images.py ImageProcessing;
    anything it cannot do is a one-line ConfigError naming the file and key."""
    kind = str(settings.get("image_processor_type", ""))
    base = kind.removesuffix("Fast").removesuffix("Pil")
    if base not in IMAGE_PROCESSORS:
        raise ConfigError(
            f"{KEY}: {where}: image_processor_type {kind!r} is not supported "
            f"(supported: {', '.join(IMAGE_PROCESSORS)})"
        )
    s = {**COMMON_DEFAULTS, **IMAGE_PROCESSORS[base], **settings}
    for key in ("do_pad", "do_reduce_labels", "do_flip_channel_order"):
        if s.get(key):
            raise ConfigError(f"{KEY}: {where}: {key}=true is not supported")
    shortest_edge = resize_to = crop = None
    if s["do_resize"]:
        size = _size(s["size"], "size", where, square=False)
        if set(size) == {"shortest_edge"}:
            shortest_edge = int(size["shortest_edge"])
        elif set(size) == {"height", "width"}:
            resize_to = (int(size["height"]), int(size["width"]))
        else:
            raise ConfigError(f"{KEY}: {where}: size {size} is not supported")
    if s.get("do_center_crop"):
        c = _size(s["crop_size"], "crop_size", where, square=True)
        if set(c) != {"height", "width"}:
            raise ConfigError(f"{KEY}: {where}: crop_size {c} is not supported")
        crop = (int(c["height"]), int(c["width"]))
    return ImageProcessing(
        convert_rgb=bool(s["do_convert_rgb"]),
        shortest_edge=shortest_edge,
        resize_to=resize_to,
        resample=int(s["resample"]),
        crop=crop,
        rescale_factor=float(s["rescale_factor"]) if s["do_rescale"] else None,
        mean=_triple(s["image_mean"], "image_mean", where) if s["do_normalize"] else None,
        std=_triple(s["image_std"], "image_std", where) if s["do_normalize"] else None,
    )


def _tokens_per_image(processor: dict, image_size: int) -> int | None:
    """LlavaProcessor's count of image tokens per image, where processor_config.json says."""
    patch = processor.get("patch_size")
    if not isinstance(patch, int):
        return None
    n = (image_size // patch) ** 2 + int(processor.get("num_additional_image_tokens", 0))
    return n - 1 if processor.get("vision_feature_select_strategy") == "default" else n


def _chat_template(folder: Path, processor: dict) -> tuple[str | None, str]:
    """The folder's chat template and the file it came from (see the module docstring)."""
    candidates: list[tuple[Any, str]] = [(processor.get("chat_template"), "processor_config.json")]
    if (folder / "chat_template.json").is_file():
        value = read_json(folder / "chat_template.json", KEY).get("chat_template")
        candidates.append((value, "chat_template.json"))
    if (folder / "chat_template.jinja").is_file():
        text = read_text(folder / "chat_template.jinja", KEY)
        candidates.append((text, "chat_template.jinja"))
    tokenizer_config = read_json(folder / "tokenizer_config.json", KEY)
    candidates.append((tokenizer_config.get("chat_template"), "tokenizer_config.json"))
    for value, name in candidates:
        if value is None:
            continue
        where = str(folder / name)
        if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
            value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(value, dict):
            if "default" not in value:
                raise ConfigError(f"{KEY}: {where}: named chat templates without a 'default' one")
            value = value["default"]
        if not isinstance(value, str):
            raise ConfigError(f"{KEY}: {where}: the chat template must be a string")
        return value, where
    return None, str(folder)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compiled(template: str, where: str) -> jinja2.Template:
    """The template compiled in transformers' chat-template environment: a sandbox with
    trim_blocks and lstrip_blocks, loop controls, the {% generation %} block (rendered as its
    body), a tojson that does not escape HTML, raise_exception and strftime_now. A syntax error
    is a ConfigError naming `where`, its file."""
    import jinja2

    if template not in _TEMPLATES:
        try:
            _TEMPLATES[template] = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"{KEY}: {where}: chat template line {e.lineno}: {e}") from None
    return _TEMPLATES[template]


def _environment() -> ImmutableSandboxedEnvironment:
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
