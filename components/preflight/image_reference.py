"""The container image reference grammar (github.com/distribution/reference) and the tags read off an image: the
image check parses the job's image with it; the version readers take an operator's release from its image tag."""

from __future__ import annotations

import re

# The distribution reference grammar (github.com/distribution/reference): [domain/]path[:tag][@digest].
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|-+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|{_IPV6})"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(
    rf"(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?"
)
ECR = re.compile(r"(?P<account>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?")
MAX_NAME_LENGTH = 255


def parse_reference(image: str) -> dict[str, str]:
    """{domain, path, tag, digest} of a well-formed image reference; ValueError naming what is wrong."""
    match = IMAGE_REFERENCE.fullmatch(image)
    if match is None:
        raise ValueError(_reference_problem(image))
    parts = {k: v or "" for k, v in match.groupdict().items()}
    domain = parts["domain"]
    if domain and not ("." in domain or ":" in domain or domain == "localhost" or domain != domain.lower()):
        parts["domain"], parts["path"] = "", f"{domain}/{parts['path']}"  # "library/ubuntu": a path, no registry
    name = (parts["domain"] + "/" if parts["domain"] else "") + parts["path"]
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"the repository name is longer than {MAX_NAME_LENGTH} characters")
    algorithm, _, hexdigits = parts["digest"].partition(":")
    if algorithm == "sha256" and len(hexdigits) != 64:
        raise ValueError(f"a sha256 digest has 64 hex digits, this one {len(hexdigits)}")
    return parts


def _reference_problem(image: str) -> str:
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    repository = name.rsplit(":", 1)[0] if ":" in last else name
    first, _, rest = repository.partition("/")
    path = rest if rest and ("." in first or ":" in first or first == "localhost") else repository
    if not image:
        return "it is empty"
    if any(c.isspace() for c in image):
        return "it contains whitespace"
    if "://" in image:
        return "a reference has no scheme (drop the https://)"
    if digest and not re.fullmatch(_DIGEST, digest):
        return f"digest {digest!r} is not algorithm:hex (sha256:<64 hex digits>)"
    if last.count(":") > 1 or last.endswith(":"):
        return "the tag is empty or has a ':'"
    if ":" in last and not re.fullmatch(_TAG, last.split(":", 1)[1]):
        return f"tag {last.split(':', 1)[1]!r} is not [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}"
    if path != path.lower():
        return f"repository {path!r} has uppercase letters"
    return "repository path components are lowercase letters and digits separated by '.', '_', '__' or '-'"


# A release version as operators tag their images and label their Deployments ("v1.8.1", "0.14.0-rc.1").
SEMVER = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:[-+][0-9A-Za-z.+-]+)?")


def image_tag(image: str) -> str:
    """The tag of an image reference ("" where it has none), its digest dropped."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else ""
