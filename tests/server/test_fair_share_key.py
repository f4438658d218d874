"""`--fair-share-key`: where a request's user comes from (a header, or the OpenAI body's
`user`), parsed with a clear error, and carried through both endpoints into the engine's
request (`Request.fair_key`) - and no key without the flag."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

import httpx  # noqa: E402

from spaceserve.server.app import ServerThread  # noqa: E402
from spaceserve.server.flags import build_parser  # noqa: E402
from spaceserve.server.settings import FairShareKey, ServeSettings  # noqa: E402

from .conftest import MODEL, make_app, null_engine  # noqa: E402


def test_the_flag_parses_header_and_user_and_names_a_bad_value() -> None:
    parse = build_parser().parse_args
    assert ServeSettings.from_args(parse([])).fair_share_key is None
    key = ServeSettings.from_args(parse(["--fair-share-key", "header:X-User"])).fair_share_key
    assert key == FairShareKey("header", "x-user")
    assert FairShareKey.parse("user") == FairShareKey("user")
    for bad in ("X-User", "header:", "cookie:a", "header:a b"):
        with pytest.raises(ValueError, match="--fair-share-key"):
            FairShareKey.parse(bad)
    key = FairShareKey("header", "x-user", max_len=4)
    assert key.of({"x-user": "alice"}, "bob") == "header:alic"
    assert key.of({}, "bob") is None and FairShareKey("user").of({}, "bob") == "user:bob"


@pytest.mark.parametrize("spec", [None, "header:X-User", "user"])
def test_the_key_reaches_the_engine_from_both_endpoints(preprocessor, spec) -> None:
    engine = null_engine(preprocessor)
    keys: list = []
    add = engine.add_request

    def spy(*args, **kw):
        keys.append(kw.get("fair_key"))
        return add(*args, **kw)

    engine.add_request = spy
    client, app = make_app(engine, preprocessor)
    app.state.fair_share_key = FairShareKey.parse(spec)
    want = {None: None, "header:X-User": "header:alice", "user": "user:bob"}[spec]
    try:
        with ServerThread(app) as server:
            with httpx.Client(base_url=server.url, timeout=30,
                              headers={"X-User": "alice"}) as c:
                body = {"model": MODEL, "max_tokens": 2, "user": "bob"}
                r = c.post("/v1/chat/completions",
                           json=body | {"messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text
                r = c.post("/v1/completions", json=body | {"prompt": ["a", "b"], "n": 2})
                assert r.status_code == 200, r.text
        assert keys == [want] * 3
    finally:
        client.close()
