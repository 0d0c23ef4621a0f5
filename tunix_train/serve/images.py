"""Images in chat requests, as a hostile client may send them: counted against the context and a
per-request cap before any is read, their pixels summed from their headers before any is decoded,
data: URIs only unless remote fetching is allowed, never a file."""

import dataclasses

from tunix_train.serve.schema import BadRequest


@dataclasses.dataclass(frozen=True)
class Images:
    """Which images a chat request may carry in its image_url parts: at most max_images of them and
    max_pixels in all (counted from their headers, before any is decoded); data: URIs of at most
    max_bytes, and http(s) URLs only when allow_remote (fetched with a deadline and the same
    bound); never a file."""

    max_bytes: int = 10 << 20
    allow_remote: bool = False
    fetch_seconds: float = 10.0
    max_images: int = 8
    max_pixels: int = 32 << 20

    def count_marks(self, body: bytes) -> None:
        """count's first test, on the raw body: an image_url part names "image_url" twice (its type
        and its key), and only a JSON token can (a quote inside a string is escaped)."""
        self._at_most(body.count(b'"image_url"') // 2)

    def count(self, urls: list, text_tokens: int, fewest_tokens: int, limit: int) -> None:
        """A 400 at once for more images than max_images, or than the context holds beside the
        text's tokens (each image takes at least fewest_tokens): nothing is read yet."""
        self._at_most(len(urls))
        if text_tokens + len(urls) * fewest_tokens >= limit:
            raise BadRequest(
                f"the prompt's {len(urls)} images take at least {len(urls) * fewest_tokens} tokens, which "
                f"with its text pass this server's {limit} (--max_len)",
                "messages",
                code="context_length_exceeded",
            )

    def _at_most(self, images: int) -> None:
        if images > self.max_images:
            raise BadRequest(
                f"{images} images; this server takes at most {self.max_images} a request (--max_images)",
                "messages",
                code="too_many_images",
            )

    def decoded_pixels(self, model, blobs: list[bytes]):
        """The images as the model's tower takes them, once their headers (format, size) pass:
        at most max_pixels in all, else a 400 before any is decoded."""
        from tunix_train.data.images import opened

        pixels = sum(
            image.width * image.height
            for image in (opened(b, f"messages: image {i + 1}") for i, b in enumerate(blobs))
        )
        if pixels > self.max_pixels:
            raise BadRequest(
                f"the images hold {pixels:,} pixels; this server decodes at most {self.max_pixels:,} a "
                f"request (--max_image_pixels)",
                "messages",
                code="image_too_large",
            )
        return model.pixel_values(blobs, None, "messages")

    def read(self, url) -> bytes:
        """An image_url part's bytes, or a 400 / 413 naming what is wrong."""
        from tunix_train.config import ConfigError
        from tunix_train.data.images import data_uri_bytes

        if not isinstance(url, str) or not url:
            raise BadRequest("an image_url part needs a string 'url'", "messages")
        if url.startswith("data:"):
            if len(url.partition(",")[2]) * 3 // 4 > self.max_bytes:
                raise self._too_large()
            try:
                return data_uri_bytes(url, "messages")
            except ConfigError as err:
                raise BadRequest(str(err), "messages") from None
        if url.startswith(("http://", "https://")):
            if not self.allow_remote:
                raise BadRequest(
                    "this server does not fetch remote images (--allow_remote_images): send the image "
                    "as a data: URI",
                    "messages",
                    code="remote_image_refused",
                )
            return self._fetch(url)
        raise BadRequest(
            f"an image_url must be a data: URI{' or an http(s) URL' if self.allow_remote else ''}; "
            f"this server reads no files (got {url[:40]!r})",
            "messages",
        )

    def _too_large(self) -> BadRequest:
        return BadRequest(
            f"an image is larger than this server's {self.max_bytes} bytes (--max_image_bytes)",
            "messages",
            status=413,
            code="image_too_large",
        )

    def _fetch(self, url: str) -> bytes:
        import urllib.request

        try:
            with urllib.request.urlopen(url, timeout=self.fetch_seconds) as response:
                data = response.read(self.max_bytes + 1)
        except Exception as err:  # noqa: BLE001 - any failure to fetch is the client's URL's
            raise BadRequest(
                f"the image at {url[:80]!r} cannot be fetched ({type(err).__name__})", "messages"
            ) from None
        if len(data) > self.max_bytes:
            raise self._too_large()
        return data
