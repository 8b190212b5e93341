"""Prompts with images: read from the dataset as encoded bytes, one placeholder per image in the ids."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image as PILImage

from streamrl.common.errors import ConfigError
from streamrl.coordinator.config import DatasetConfig
from streamrl.coordinator.prompts import BadRowError, PromptSource, read_images
from streamrl.torchkit.testing import IMAGE_TOKEN, build_tiny_idefics3


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_idefics3(tmp_path_factory.mktemp("vl")))


def png(color: tuple[int, int, int], kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (20, 12), color).save(out, kind)
    return out.getvalue()


def dataset(tmp_path: Path, rows: list[dict]) -> str:  # type: ignore[type-arg]
    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "red.png").write_bytes(png((255, 0, 0)))
    (tmp_path / "img" / "blue.jpg").write_bytes(png((0, 0, 255), "JPEG"))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "data.jsonl")


def test_a_row_with_images_gets_its_bytes_and_one_placeholder_per_image(tmp_path: Path, vl_dir: str) -> None:
    path = dataset(
        tmp_path,
        [
            {"prompt": "which colour", "label": "red", "images": ["img/red.png", "img/blue.jpg"]},
            {"prompt": "no picture", "label": "x"},
        ],
    )
    source = PromptSource(DatasetConfig(path=path, tokenizer=vl_dir, shuffle=False))
    image_id = source.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    with_images, plain = source.encode(0), source.encode(1)
    assert [i.media_type for i in with_images.images] == ["image/png", "image/jpeg"]
    assert with_images.images[0].data == (tmp_path / "img" / "red.png").read_bytes()
    assert with_images.ids.count(image_id) == 2
    assert with_images.text.index(IMAGE_TOKEN) < with_images.text.index("which colour")  # images before the text
    assert "images" not in with_images.metadata  # not handed to the reward function as a field
    assert plain.images == () and image_id not in plain.ids and plain.text == "no picture"


def test_images_placed_by_chat_messages_stay_where_they_are(tmp_path: Path, vl_dir: str) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "left"}, {"type": "image"}, {"type": "text", "text": "right"}],
        }
    ]
    path = dataset(tmp_path, [{"prompt": messages, "images": "img/red.png"}])
    prompt = PromptSource(DatasetConfig(path=path, tokenizer=vl_dir, label_key=None)).encode(0)
    assert "left" + IMAGE_TOKEN + "right" in prompt.text and len(prompt.images) == 1


@pytest.mark.parametrize(
    ("images", "error"),
    [
        ("img/missing.png", "row 0: image 'img/missing.png' not found"),
        ("data.jsonl", "row 0: image 'data.jsonl' is not PNG, JPEG, GIF, WebP or BMP"),
        ([3], "row 0: an image must be a path or {'bytes': ...}, got int"),
    ],
)
def test_a_bad_image_names_the_row_and_the_image(tmp_path: Path, vl_dir: str, images: object, error: str) -> None:
    path = dataset(tmp_path, [{"prompt": "p", "images": images}])
    with pytest.raises(ConfigError, match=error.replace("{", r"\{").replace("}", r"\}").replace("(", r"\(")):
        PromptSource(DatasetConfig(path=path, tokenizer=vl_dir, label_key=None)).encode(0)


def test_image_parts_and_images_must_agree(tmp_path: Path, vl_dir: str) -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "t"}]}]
    path = dataset(tmp_path, [{"prompt": messages, "images": ["img/red.png"]}])
    with pytest.raises(ConfigError, match="row 0: the messages hold 2 image parts but the row has 1 images"):
        PromptSource(DatasetConfig(path=path, tokenizer=vl_dir, label_key=None)).encode(0)


def test_hugging_face_image_columns_and_webp_are_read(tmp_path: Path) -> None:
    webp = io.BytesIO()
    PILImage.new("RGB", (8, 8)).save(webp, "WEBP")
    images = read_images([{"bytes": png((1, 2, 3)), "path": None}, {"bytes": webp.getvalue()}], tmp_path, "row 7")
    assert [i.media_type for i in images] == ["image/png", "image/webp"]


def test_a_row_whose_image_is_missing_is_bad_the_others_are_read(tmp_path: Path, vl_dir: str) -> None:
    path = dataset(
        tmp_path,
        [
            {"prompt": "a", "images": "img/red.png"},
            {"prompt": "b", "images": "img/gone.png"},
            {"prompt": "c", "images": ["img/blue.jpg"]},
        ],
    )
    source = PromptSource(DatasetConfig(path=path, tokenizer=vl_dir, label_key=None, shuffle=False))
    with pytest.raises(BadRowError, match=r"row 1: image 'img/gone.png' not found"):
        source.encode(1)
    assert [len(source.encode(i).images) for i in (0, 2)] == [1, 1]
