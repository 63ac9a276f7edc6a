"""Issue 24 item 3: ``POST /v1/images/edits`` with the official ``openai`` client on a
tiny FLUX over real uvicorn on loopback (image-to-image, and with a mask inpainting, by
the variants diffusers' ``from_pipe`` builds over the same weights), the upload checks,
and the edits under module and layer offload equal to the resident run."""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from diffusion_offload.engine import Omni, SamplingParams  # noqa: E402
from diffusion_offload.server.errors import APIError  # noqa: E402
from diffusion_offload.server.uploads import decode_upload  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402
from test_server_knobs import KEY, Server, error  # noqa: E402

EDITS = "/v1/images/edits"


def picture(size: tuple[int, int] = (32, 32)) -> Image.Image:
    w, h = size
    return Image.fromarray((np.arange(w * h * 3).reshape(h, w, 3) * 7 % 251).astype("uint8"))


def encoded(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def square_mask() -> Image.Image:
    mask = Image.new("L", (32, 32), 0)
    mask.paste(255, (8, 8, 24, 24))
    return mask


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipelines.save("flux", tmp_path_factory.mktemp("edits") / "flux")


@pytest.fixture(scope="module")
def flux(flux_dir: Path) -> Iterator[Server]:
    server = Server(Omni(str(flux_dir), device="cpu", progress=False))
    yield server
    server.stop()


def test_openai_images_edit_with_and_without_a_mask(flux: Server, flux_dir: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{flux.url}/v1", api_key=KEY, max_retries=0)
    extra = {"seed": 3, "num_inference_steps": 2, "strength": 0.9}
    png = encoded(picture())
    edit = client.images.edit(model="tiny", image=("in.png", png, "image/png"), prompt="a red car",
                              response_format="b64_json", extra_body=extra)
    masked = client.images.edit(model="tiny", image=("in.png", png, "image/png"),
                                mask=("mask.png", encoded(square_mask()), "image/png"),
                                prompt="a red car", response_format="b64_json", extra_body=extra)
    a, b = (Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))) for r in (edit, masked))
    assert a.size == b.size == (32, 32)
    engine = flux.engine
    assert {k: type(v[0]).__name__ for k, v in engine._variants.items()} == {
        "image2image": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline"}
    for variant, _, _ in engine._variants.values():  # every weight shared with the served one
        assert variant.transformer is engine.pipeline.transformer and variant.vae is engine.pipeline.vae
    params = SamplingParams(height=32, width=32, num_inference_steps=2, seed=3, extra={"strength": 0.9})
    alone = engine.generate({"prompt": "a red car", "image": picture()}, params)[0].images[0]
    assert np.array_equal(np.asarray(a), np.asarray(alone))
    alone = engine.generate({"prompt": "a red car", "image": picture(), "mask": square_mask()},
                            params)[0].images[0]
    assert np.array_equal(np.asarray(b), np.asarray(alone))
    assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_uploads_are_checked_and_named(flux: Server) -> None:
    with flux.client() as c:
        def post(files: dict, **data: str):
            return c.post(EDITS, files=files, data={"prompt": "x", "num_inference_steps": "2",
                                                    **data})

        err = error(post({"image": ("a.txt", b"not an image", "text/plain")}))
        assert err["param"] == "image" and "not a PNG, JPEG or WebP" in err["message"]
        err = error(post({"image": ("a.gif", encoded(picture(), "GIF"), "image/gif")}))
        assert err["param"] == "image"
        err = error(post({"image": ("a.png", encoded(picture())),
                          "mask": ("m.png", encoded(Image.new("L", (16, 16))))}))
        assert err["param"] == "mask" and "same size" in err["message"]
        assert error(post({"image": (None, "text")}))["param"] == "image"
        assert error(c.post(EDITS, files={"image": ("a.png", encoded(picture()))}))["param"] == "prompt"
        err = error(post({"image": ("a.png", encoded(picture()))}, latents="1"))
        assert err["param"] == "latents"
        err = error(post({"image": ("a.png", encoded(picture()))}, strength="2"))
        assert err["param"] == "strength"
        for fmt in ("JPEG", "WEBP"):
            r = post({"image": (f"a.{fmt}", encoded(picture(), fmt), f"image/{fmt.lower()}")},
                     seed="1", strength="0.9")
            assert r.status_code == 200, r.text


def test_decode_upload_refuses_bombs_before_decoding_and_applies_exif() -> None:
    big = encoded(Image.new("RGB", (4000, 4000)))  # a small file of 16 MP
    assert len(big) < 200_000
    with pytest.raises(APIError, match="4000x4000 = 16000000 pixels is over") as err:
        decode_upload("image", big, max_pixels=2_097_152)
    assert err.value.param == "image"
    with pytest.raises(APIError, match="over the limit of 10"):
        decode_upload("mask", encoded(picture()), 10**6, max_bytes=10)
    tall = picture((16, 32))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: shown 32 wide, 16 high
    decoded = decode_upload("image", encoded(tall, "JPEG", exif=exif.tobytes(), quality=95), 10**6)
    assert decoded.size == (32, 16) and decoded.mode == "RGB"


@pytest.mark.slow
def test_edits_under_module_and_layer_offload_equal_resident_sharing_weights(flux_dir: Path) -> None:
    params = SamplingParams(height=32, width=32, num_inference_steps=2, seed=1, extra={"strength": 0.9})
    requests = [{"prompt": "a car", "image": picture()},
                {"prompt": "a car", "image": picture(), "mask": square_mask()}]
    outputs = {}
    for name, config in (("resident", None), ("module", {"mode": "module", "components": ["dit", "text_encoder"]}),
                         ("layer", {"mode": "layer", "components": ["dit"]})):
        with Omni(str(flux_dir), config, device="fakegpu", progress=False) as engine:
            stats = engine.stats
            # host copies: the check buffers a request makes are counted apart
            before = (stats.pinned_bytes, stats.pageable_host_bytes)
            outputs[name] = [np.asarray(engine.generate(r, params)[0].images[0]) for r in requests]
            if engine.backend is not None:
                assert engine.backend.audit() == []
                assert (stats.pinned_bytes, stats.pageable_host_bytes) == before
    for name in ("module", "layer"):
        assert all(np.array_equal(x, y) for x, y in zip(outputs["resident"], outputs[name])), name


def test_openai_chat_completions_returns_images_and_edits(flux: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{flux.url}/v1", api_key=KEY, max_retries=0)
    extra = {"seed": 3, "num_inference_steps": 2, "size": "32x32", "n": 2}
    r = client.chat.completions.create(model="tiny", messages=[
        {"role": "system", "content": "you draw"}, {"role": "user", "content": "a red car"}],
        temperature=0.7, extra_body=extra)
    parts = r.choices[0].message.content
    assert [p["type"] for p in parts] == ["image_url", "image_url"]
    urls = [p["image_url"]["url"] for p in parts]
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    with flux.client() as c:
        same = c.post("/v1/images/generations", json={"prompt": "a red car", **extra}).json()
    assert [u.split(",", 1)[1] for u in urls] == [d["b64_json"] for d in same["data"]]
    # an image part in the last user message makes it an edit
    data_url = "data:image/png;base64," + base64.b64encode(encoded(picture())).decode()
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "text", "text": "a red car"}, {"type": "image_url", "image_url": {"url": data_url}}]}],
        extra_body={"seed": 3, "num_inference_steps": 2, "strength": 0.9})
    edited = base64.b64decode(r.choices[0].message.content[0]["image_url"]["url"].split(",", 1)[1])
    params = SamplingParams(height=32, width=32, num_inference_steps=2, seed=3, extra={"strength": 0.9})
    alone = flux.engine.generate({"prompt": "a red car", "image": picture()}, params)[0].images[0]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(edited))), np.asarray(alone))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="dall-e-3", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    assert "data URL" in err.value.body["message"]
    with flux.client() as c:
        r = httpx.post(f"{flux.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401  # the same auth as images
