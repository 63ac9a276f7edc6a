"""The endpoints and the exception handlers that turn every error into OpenAI's envelope."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from .errors import APIError
from .jobs import COMPLETED, QUEUED, Job
from .metrics import CONTENT_TYPE_LATEST
from .schemas import (
    ImageGenerationRequest,
    VideoGenerationRequest,
    check_limits,
    form_to_dict,
    pipeline_kwargs,
    validation_error,
)
from .middleware import key_matches
from .served import ServedModel
from .state import BaseServerState, ClientGone, JobSpec, random_seed

__all__ = ["add_routes"]

logger = logging.getLogger("diffusion_offload.server")

_JSON = "application/json"
_MULTIPART = "multipart/form-data"
_URLENCODED = "application/x-www-form-urlencoded"


def _resolve(m: ServedModel, req: Any, video: bool) -> dict[str, Any]:
    """The request's size, steps and frames with omitted fields set to the served model's
    defaults (a make-tiny model's small ones, else the pipeline's)."""
    from ..models.rules import DEFAULT_FPS, frames_for_seconds

    rules = m.rules
    defaults = dict(rules.defaults) if rules is not None else {}
    width, height = req.dimensions or (None, None)
    values: dict[str, Any] = {
        "width": width if width is not None else defaults.get("width"),
        "height": height if height is not None else defaults.get("height"),
        "num_inference_steps": req.num_inference_steps
        if req.num_inference_steps is not None
        else defaults.get("num_inference_steps"),
    }
    if video:
        if req.seconds is not None:
            fps = req.fps or DEFAULT_FPS
            values["num_frames"] = frames_for_seconds(req.duration, fps, m.limits.frame_step)
        else:
            values["num_frames"] = (
                req.num_frames if req.num_frames is not None else defaults.get("num_frames")
            )
    return values


def _prompt_item(req: Any) -> Any:
    """The engine's prompt item: the text, or ``{"prompt", "negative_prompt"}``."""
    if req.negative_prompt is None:
        return req.prompt
    return {"prompt": req.prompt, "negative_prompt": req.negative_prompt}


def _image_input(engine: Any) -> tuple[str | None, str]:
    """``(how the model takes an image, its pipeline class)``: ``Omni.image_input``
    (``"required"``, ``"optional"`` or None; Ray's remote engine reports the generators'),
    None for engines that do not say (test doubles)."""
    return getattr(engine, "image_input", None), getattr(engine, "pipeline_class", "this model")


def _params(limits: Any, req: Any, values: dict[str, Any], text: bool, **fields: Any) -> Any:
    """``SamplingParams`` of a validated request: its resolved values, knobs (checked
    against ``limits``' knob table: the served model's, or its edit pipeline's) and seed."""
    from ..engine.params import SamplingParams

    return SamplingParams(
        height=values["height"],
        width=values["width"],
        num_inference_steps=values["num_inference_steps"],
        guidance_scale=req.guidance_scale,
        seed=req.seed if req.seed is not None else random_seed(),
        flow_shift=req.flow_shift,
        boundary_ratio=req.boundary_ratio,
        extra=pipeline_kwargs(req, limits, text=text) or None,
        **fields,
    )


def _form_json(data: dict[str, Any]) -> dict[str, Any]:
    """A form's ``extra_params``, sent as JSON text, decoded (an object is required)."""
    text = data.get("extra_params")
    if isinstance(text, str):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise APIError(400, "Invalid value for 'extra_params': a form sends it as a JSON "
                                f"object, e.g. '{{\"true_cfg_scale\": 4.0}}', got {text[:80]!r}.",
                           param="extra_params", code="invalid_value")
        data = {**data, "extra_params": value}
    return data


_IMAGE_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has disconnected (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _read_form(request: Request, max_files: int, field: str, limit_text: str) -> Any:
    """The request's form, with Starlette's count of files capped at ``max_files`` (its
    default is 1,000); more is a 400 naming ``field`` with ``limit_text``."""
    try:
        return await request.form(max_files=max_files)
    except StarletteHTTPException as exc:
        if "Too many files" not in str(exc.detail):
            raise
        raise APIError(400, f"Invalid value for '{field}': the form carries more than "
                            f"{max_files} files; this server takes {limit_text}.",
                       param=field, code="invalid_value") from None


def _media_type(request: Request) -> str:
    return (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()


def _wrong_content_type(got: str, allowed: tuple[str, ...]) -> APIError:
    return APIError(
        400,
        f"Unsupported Content-Type {got or '(none)'!r}; send {' or '.join(allowed)}.",
        code="unsupported_content_type",
    )


def add_routes(app: FastAPI, state: BaseServerState) -> None:
    """Register the endpoints and exception handlers of ``state`` on ``app``."""
    settings = state.settings

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message, code = f"Unknown path {request.url.path!r}.", "not_found"
        elif exc.status_code == 405:
            message, code = (
                f"Method {request.method} is not allowed on {request.url.path!r}.",
                "method_not_allowed",
            )
        else:
            message, code = str(exc.detail), None
        return APIError(
            exc.status_code, message, code=code, headers=getattr(exc, "headers", None)
        ).response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = (exc.errors() or [{}])[0]
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
        return APIError(
            400,
            f"Invalid request: {err.get('msg', 'invalid')}.",
            param=loc[-1] if loc else None,
            code="invalid_value",
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = f"req_{secrets.token_hex(8)}"
        logger.error(
            "request %s: unexpected error on %s %s",
            request_id,
            request.method,
            request.url.path,
            exc_info=exc,
        )
        return APIError(
            500,
            f"Internal server error (request id {request_id}); the server log has the details.",
            code="internal_error",
            headers={"X-Request-ID": request_id},
        ).response()

    # -------------------------------------------------------------- health, models, metrics

    @app.get("/health")
    async def health(request: Request) -> Any:
        """``{"status": "ok"}`` (200) once the model is loaded; ``"loading"`` or
        ``"failed"`` (503) before, ``"shutting_down"`` (503) after SIGTERM. No key is
        needed; details (the Ray server's replicas) only for a caller with a valid key,
        or anyone when no key is set."""
        key = settings.api_key
        authorized = key is None or key_matches(request.headers.get("authorization"), key)
        body = await state.health_report(authorized)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    def model_cards() -> dict[str, dict[str, Any]]:
        """id -> the OpenAI model object of each served model (ids as given on the command
        line), with where its weights are now (``device_bytes``, ``host_bytes``,
        ``disk_bytes``), its ``kind`` and its ``requests`` and ``swaps`` (a pool's)."""
        cards = {}
        loaded = {m.id: m for m in state.models.values()}
        described = {d["id"]: d for d in state.describe_models()}
        for model_id in state.settings.model_ids:
            card = {"id": model_id, "object": "model", "created": state.loaded_at,
                    "owned_by": "diffusion-offload"}
            if model_id in loaded:
                card["kind"] = "video" if getattr(loaded[model_id].engine, "is_video", False) else "image"
            card.update({k: v for k, v in described.get(model_id, {}).items() if k != "id"})
            cards[model_id] = card
        return cards

    @app.get("/v1/models")
    async def list_models() -> Any:
        """Every served model."""
        return {"object": "list", "data": list(model_cards().values())}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Any:
        """The model, if ``model_id`` is one of the served ids."""
        card = model_cards().get(model_id)
        if card is None:
            served = ", ".join(repr(m) for m in state.settings.model_ids)
            raise APIError(
                404,
                f"The model {model_id!r} does not exist; this server serves {served}.",
                param="model",
                code="model_not_found",
            )
        return card

    @app.post("/v1/models/{model_id:path}/release")
    async def release_model(model_id: str) -> Any:
        """Put the model to sleep now (its weights evicted to the host; the next request
        wakes it): ``{"id", "released_bytes"}``; 409 for a model that keeps no host copy of
        its resident weights (one model served without ``--idle-release``)."""
        from .idle import NotSleepable, release

        if model_id not in state.settings.model_ids:
            served = ", ".join(repr(m) for m in state.settings.model_ids)
            raise APIError(404, f"The model {model_id!r} does not exist; this server serves {served}.",
                           param="model", code="model_not_found")
        m = state.served(model_id)
        several = len(state.settings.model_ids) > 1
        try:
            freed = await asyncio.to_thread(release, state.engine, m.id if several else None)
        except NotSleepable as exc:
            raise APIError(409, f"The model {m.id!r} cannot be released: {exc}.", param="model",
                           code="not_sleepable") from None
        return {"id": m.id, "object": "model.release", "released_bytes": freed}

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(await state.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    # -------------------------------------------------------------- images

    @app.post("/v1/images/generations")
    async def images_generations(request: Request) -> Any:
        """Generate ``n`` images (PNG, or ``output_format``); answers when they are done."""
        media = _media_type(request)
        if media != _JSON:
            raise _wrong_content_type(media, (_JSON,))
        try:
            req = ImageGenerationRequest.model_validate_json(await request.body(), strict=True)
        except ValidationError as exc:
            raise validation_error(exc) from None
        m = state.served(req.model)
        return await run_images(request, m, req, _prompt_item(req), m.limits, text=False)

    async def run_images(request: Request, m: ServedModel, req: Any, prompt: Any, limits: Any,
                         text: bool, answer: Any = None) -> Any:
        """Check, queue and answer an images request (generations, edits, chat) for the
        served model ``m``; ``limits`` carries the knob table of the pipeline that runs
        it, ``text`` says the values come from a form; ``answer(images, fmt, headers)``
        builds the response (default: OpenAI's images response)."""
        engine = m.engine
        if engine.is_video:
            raise APIError(
                400,
                f"The model {m.id!r} generates videos; use POST /v1/videos.",
                param="model",
                code="unsupported_model",
            )
        values = _resolve(m, req, video=False)
        check_limits(req, m.limits, values)
        n = req.n or 1
        params = _params(limits, req, values, text=text, num_outputs_per_prompt=n)
        await state.check_request(prompt, params, engine)
        fmt = req.output_format or "png"
        as_url = req.response_format == "url"  # kept like a video job, served below
        spec = JobSpec(prompt, params, size=req.size, image_format=fmt,
                       compression=req.output_compression, model=m.id)
        job = Job("image", spec, store=as_url)
        try:
            images = await state.run_and_wait(job, lambda: _wait_disconnect(request))
        except ClientGone:
            return Response(status_code=499)  # nobody is listening
        headers = state.response_headers(job)
        if answer is not None:
            return answer(images, fmt, headers)
        if req.response_format == "file":
            return Response(images[0], media_type=_IMAGE_TYPES[fmt], headers=headers)
        if as_url:
            data = [{"url": str(request.url_for("image_file", image_id=job.id, index=i, ext=fmt)),
                     "b64_json": None, "revised_prompt": None} for i in range(n)]
        else:
            data = [{"b64_json": base64.b64encode(image).decode("ascii"), "url": None,
                     "revised_prompt": None} for image in images]
        body = {"created": int(time.time()), "data": data, "output_format": fmt}
        return JSONResponse(body, headers=headers) if headers else body

    async def edit_prompt(m: ServedModel, req: Any, images: list[Any], mask_image: Any) -> tuple[Any, Any, Any]:
        """``(req, prompt, limits)`` of an edit on ``m``: the size defaults to the image's
        (rounded down to the model's multiple), the knobs are the edit pipeline's."""
        engine = m.engine
        knobs_for = getattr(engine, "knobs_for", None)
        if knobs_for is None:
            raise APIError(400, "This server's engine cannot edit images.", param="image",
                           code="unsupported_model")
        try:
            knobs, refused = await asyncio.to_thread(knobs_for, mask_image is not None)
        except ValueError as exc:
            raise APIError(400, f"Invalid request: {exc}.", param="image",
                           code="unsupported_model") from None
        if req.dimensions is None:  # an edit keeps the image's size (a multiple of the model's)
            step = m.limits.size_multiple
            width, height = images[0].size
            req = req.model_copy(update={"width": max(step, width - width % step),
                                         "height": max(step, height - height % step)})
        prompt = {"prompt": req.prompt, "image": images if len(images) > 1 else images[0]}
        if req.negative_prompt is not None:
            prompt["negative_prompt"] = req.negative_prompt
        if mask_image is not None:
            prompt["mask"] = mask_image
        return req, prompt, replace(m.limits, knobs=knobs, refused=refused)

    @app.post("/v1/images/edits")
    async def images_edits(request: Request) -> Any:
        """Edit the uploaded ``image`` (one or more; with a ``mask``, inpaint it): the
        served pipeline's image-to-image or inpainting variant, or an edit model itself."""
        from .uploads import MAX_IMAGES, Upload, check_count, decode_uploads_async

        media = _media_type(request)
        if media != _MULTIPART:
            raise _wrong_content_type(media, (_MULTIPART,))
        form = await _read_form(request, MAX_IMAGES + 1, "image",
                                f"at most {MAX_IMAGES} images and one mask per request")
        try:
            fields: dict[str, Any] = {}
            files: dict[str, list[bytes]] = {}
            for key, value in form.multi_items():
                name = key.removesuffix("[]")
                if isinstance(value, str):
                    fields.setdefault(name, []).append(value)
                else:
                    files.setdefault(name, []).append(await value.read())
        finally:
            await form.close()
        unknown_files = set(files) - {"image", "mask"}
        if unknown_files:
            name = sorted(unknown_files)[0]
            raise APIError(400, f"Invalid type for '{name}': only 'image' and 'mask' take files.",
                           param=name, code="invalid_type")
        repeated = [k for k, v in fields.items() if len(v) > 1]
        if repeated:
            raise APIError(400, f"Invalid value for '{repeated[0]}': the field is given more "
                                "than once.", param=repeated[0], code="invalid_value")
        if "image" in fields or "mask" in fields:
            name = "image" if "image" in fields else "mask"
            raise APIError(400, f"Invalid type for '{name}': send an image file (PNG, JPEG or "
                                "WebP), not text.", param=name, code="invalid_type")
        if not files.get("image"):
            raise APIError(400, "Missing required parameter: 'image'.", param="image",
                           code="missing_required_parameter")
        check_count("image", len(files["image"]), MAX_IMAGES, "images")
        if len(files.get("mask", [])) > 1:
            raise APIError(400, "Invalid value for 'mask': give one mask.", param="mask",
                           code="invalid_value")
        try:
            req = ImageGenerationRequest.model_validate(
                _form_json({k: v[0] for k, v in fields.items()}), strict=False)
        except ValidationError as exc:
            raise validation_error(exc) from None
        m = state.served(req.model)
        uploads = [Upload("image", data) for data in files["image"]]
        uploads += [Upload("mask", data, "L") for data in files.get("mask", [])]
        decoded = await decode_uploads_async(uploads, state.limits.max_pixels)
        images = decoded[:len(files["image"])]
        mask_image = decoded[-1] if files.get("mask") else None
        if mask_image is not None and mask_image.size != images[0].size:
            raise APIError(400, f"Invalid value for 'mask': it is {mask_image.size[0]}x"
                                f"{mask_image.size[1]}, the image {images[0].size[0]}x"
                                f"{images[0].size[1]}; they must be the same size.",
                           param="mask", code="invalid_value")
        req, prompt, limits = await edit_prompt(m, req, images, mask_image)
        return await run_images(request, m, req, prompt, limits, text=True)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        """vLLM-Omni's text-to-image chat: the last user message is the prompt (an image
        part makes it an edit); the knobs come in the body (the SDK's ``extra_body``)."""
        from .chat import chat_completion, chat_request
        from .uploads import decode_uploads_async

        media = _media_type(request)
        if media != _JSON:
            raise _wrong_content_type(media, (_JSON,))
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise APIError(400, f"We could not parse the JSON body of your request: {exc}",
                           code="invalid_json") from None
        fields, uploads = chat_request(body)
        try:
            req = ImageGenerationRequest.model_validate(fields, strict=True)
        except ValidationError as exc:
            raise validation_error(exc) from None
        m = state.served(req.model)
        prompt, limits = _prompt_item(req), m.limits
        if uploads:
            images = await decode_uploads_async(uploads, state.limits.max_pixels)
            req, prompt, limits = await edit_prompt(m, req, images, None)

        def answer(images: list[bytes], fmt: str, headers: dict[str, str]) -> Any:
            return JSONResponse(chat_completion(m.id, images, fmt), headers=headers)

        return await run_images(request, m, req, prompt, limits, text=False, answer=answer)

    @app.get("/v1/images/{image_id}/{index}.{ext}", name="image_file")
    async def image_file(image_id: str, index: int, ext: str) -> Response:
        """Image ``index`` of a ``response_format="url"`` request, kept ``--job-ttl``
        seconds (404 once expired, for an unknown id, or another extension than the
        request's ``output_format``)."""
        job = await state.get_job(image_id)
        images = await state.job_content(job) if job is not None and job.kind == "image" else None
        if not images or not 0 <= index < len(images) or ext != job.payload.image_format:
            raise APIError(404, f"No image {index}.{ext} of {image_id!r} (unknown or expired).",
                           param="image_id", code="image_not_found")
        return Response(images[index], media_type=_IMAGE_TYPES[ext],
                        headers=state.response_headers(job))

    # -------------------------------------------------------------- videos

    def not_found(video_id: str) -> APIError:
        return APIError(
            404, f"No video job with id {video_id!r}.", param="video_id", code="video_not_found"
        )

    async def get_job(video_id: str) -> Job:
        """The video job ``video_id``; an ``APIError`` 404 (param ``video_id``) if unknown."""
        job = await state.get_job(video_id)
        if job is None or job.kind != "video":
            raise not_found(video_id)
        return job

    @app.post("/v1/videos")
    async def create_video(request: Request) -> Any:
        """Queue a video job; poll ``GET /v1/videos/{id}``."""
        media = _media_type(request)
        is_form = media in (_MULTIPART, _URLENCODED)
        reference: list[bytes] = []  # input_reference, uploaded in a multipart form
        try:
            if media == _JSON:
                req = VideoGenerationRequest.model_validate_json(await request.body(), strict=True)
            elif is_form:
                form = await _read_form(request, 2, "input_reference", "one image")
                try:
                    items = list(form.multi_items())
                    refs = [v for k, v in items if k == "input_reference" and not isinstance(v, str)]
                    reference = [await ref.read() for ref in refs]
                    data = form_to_dict([(k, v) for k, v in items
                                         if not (k == "input_reference" and not isinstance(v, str))])
                finally:
                    await form.close()
                req = VideoGenerationRequest.model_validate(_form_json(data), strict=False)
            else:
                raise _wrong_content_type(media, (_JSON, _MULTIPART, _URLENCODED))
        except ValidationError as exc:
            raise validation_error(exc) from None
        m = state.served(req.model)
        engine = m.engine
        if not engine.is_video:
            raise APIError(
                400,
                f"The model {m.id!r} generates images; "
                "use POST /v1/images/generations.",
                param="model",
                code="unsupported_model",
            )
        values = _resolve(m, req, video=True)
        check_limits(req, m.limits, values)
        params = _params(m.limits, req, values, text=is_form, num_frames=values["num_frames"],
                         fps=req.fps, guidance_scale_2=req.guidance_scale_2)
        prompt = _prompt_item(req)
        if reference:
            prompt = await reference_prompt(engine, req, reference)
        elif _image_input(engine)[0] == "required":
            raise APIError(400, f"Missing required parameter: 'input_reference': "
                                f"{_image_input(engine)[1]} makes videos from an image; "
                                "upload it as 'input_reference' in a multipart form.",
                           param="input_reference", code="missing_required_parameter")
        await state.check_request(prompt, params, engine)
        job = Job("video", JobSpec(prompt, params, fps=req.fps, size=req.size,
                                   seconds=req.seconds, model=m.id), store=True)
        body = state.video_object(job, status=QUEUED)
        await state.submit_job(job)
        return body

    async def reference_prompt(engine: Any, req: Any, files: list[bytes]) -> dict[str, Any]:
        """The prompt item of an image-to-video request: ``input_reference`` decoded
        (:mod:`.uploads`) for a model whose pipeline takes an ``image``; a 400 otherwise."""
        from .uploads import Upload, decode_uploads_async

        if len(files) > 1:
            raise APIError(400, "Invalid value for 'input_reference': give one image.",
                           param="input_reference", code="invalid_value")
        takes, name = _image_input(engine)
        if takes is None:
            raise APIError(400, f"Invalid value for 'input_reference': {name} makes videos from "
                                "text only; an image-to-video model (such as Wan2.2-I2V-A14B, "
                                "WanImageToVideoPipeline) takes a reference image.",
                           param="input_reference", code="unsupported_parameter")
        (image,) = await decode_uploads_async([Upload("input_reference", files[0])],
                                              state.limits.max_pixels)
        item = {"prompt": req.prompt, "image": image}
        if req.negative_prompt is not None:
            item["negative_prompt"] = req.negative_prompt
        return item

    @app.get("/v1/videos")
    async def list_videos(request: Request) -> Any:
        """Video jobs, newest first (``order=asc``: oldest first), ``limit`` 1-100, ``after``."""
        query = request.query_params
        raw_limit = query.get("limit", "20")
        try:
            limit = int(raw_limit)
            if not 1 <= limit <= 100:
                raise ValueError
        except ValueError:
            raise APIError(
                400,
                f"Invalid value for 'limit': must be an integer from 1 to 100, got {raw_limit!r}.",
                param="limit",
                code="invalid_value",
            ) from None
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(
                400,
                f"Invalid value for 'order': must be 'asc' or 'desc', got {order!r}.",
                param="order",
                code="invalid_value",
            )
        jobs = [job for job in await state.list_jobs() if job.kind == "video"]
        if order == "desc":
            jobs.reverse()
        after = query.get("after")
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise APIError(
                    400,
                    f"Invalid value for 'after': no video job with id {after!r}.",
                    param="after",
                    code="invalid_value",
                )
            jobs = jobs[ids.index(after) + 1 :]
        page = jobs[:limit]
        return {
            "object": "list",
            "data": [state.video_object(j) for j in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": len(jobs) > limit,
        }

    @app.get("/v1/videos/{video_id}")
    async def retrieve_video(video_id: str) -> Any:
        """A video job: status, progress, and the error when failed."""
        return state.video_object(await get_job(video_id))

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, request: Request) -> Response:
        """The mp4 of a completed job (409 until then)."""
        job = await get_job(video_id)
        variant = request.query_params.get("variant", "video")
        if variant != "video":
            raise APIError(
                400,
                f"Invalid value for 'variant': only 'video' is available, got {variant!r}.",
                param="variant",
                code="invalid_value",
            )
        if job.status != COMPLETED:
            if job.status == "failed":
                message = f"Video {video_id} failed: {(job.error or {}).get('message')}"
            else:
                message = f"Video {video_id} is {job.status}; its content is not ready."
            raise APIError(409, message, param="video_id", code="video_not_ready")
        data = await state.job_content(job)
        if data is None:  # expired or deleted since
            raise not_found(video_id)
        return Response(
            data,
            media_type="video/mp4",
            headers={
                "Content-Disposition": f'attachment; filename="{video_id}.mp4"',
                **state.response_headers(job),
            },
        )

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> Any:
        """Cancel a queued or running job (stopped at its next step) or delete a finished one."""
        await get_job(video_id)  # 404 for an image id
        try:
            await state.delete_job(video_id)
        except KeyError:
            raise not_found(video_id) from None
        return {"id": video_id, "object": "video.deleted", "deleted": True}
