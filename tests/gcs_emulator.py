"""gcp-storage-emulator with what of GCS it lacks and the project relies on:
- generation preconditions, which it ignores: an object insert, delete or rewrite that carries
  ifGenerationMatch (0: only if the object does not exist) is refused with 412 unless the object's
  generation (a rewrite's: its destination's) is that one, checked and applied in one step, as GCS
  does. The run folder's gs:// lock and the fenced checkpoint commit (lock.py, storage.py) rely on
  them;
- moveTo (an object renamed within its bucket, its custom metadata kept), which it answers with 501:
  gcsfs's mv tries it first and retried the 501 for about a minute before it copied and deleted.
tests/helpers.py's GCSEmulator starts this instead of the plain emulator.

usage: python tests/gcs_emulator.py start --host 127.0.0.1 --port PORT ...   (gcp-storage-emulator's
arguments)
"""

import threading
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_ONE_AT_A_TIME = threading.Lock()  # the server answers each request in a thread


def _target(request):
    """(bucket, object) a request's precondition is about: a rewrite's destination, else its
    object."""
    params = request.params or {}
    if "dest_object_id" in params:
        return params["dest_bucket_name"], params["dest_object_id"]
    data = request.data if isinstance(request.data, dict) else {}
    name = (
        params.get("object_id")
        or (request.query.get("name") or [None])[0]
        or data.get("meta", {}).get("name")
    )
    return params["bucket_name"], name


def _with_precondition(handler):
    def handle(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        if not wanted:
            return handler(request, response, storage, *args, **kwargs)
        with _ONE_AT_A_TIME:
            try:
                generation = str(storage.get_file_obj(*_target(request))["generation"])
            except NotFound:
                generation = "0"
            if generation != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                return None
            return handler(request, response, storage, *args, **kwargs)

    return handle


def move(request, response, storage, *args, **kwargs):
    """GCS's objects.move: the object under its new name in the same bucket, then the old name
    gone."""
    bucket, source, destination = (
        request.params[k] for k in ("bucket_name", "object_id", "dest_object_id")
    )
    with _ONE_AT_A_TIME:
        try:
            moved = objects._copy(request.base_url, storage, bucket, source, bucket, destination)
            storage.delete_file(bucket, source)
        except NotFound:
            response.status = HTTPStatus.NOT_FOUND
            return
    response.json(moved)


objects.insert = _with_precondition(objects.insert)
objects.delete = _with_precondition(objects.delete)
objects.rewrite = _with_precondition(objects.rewrite)
# after the patch: the server's routes name the handlers as they are when it is imported
from gcp_storage_emulator import server  # noqa: E402

# before the generic object path, which would take ".../o/a/moveTo/o/b" for an object named so
server.HANDLERS = (
    *(
        (
            rf"^{prefix}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
            r"(?P<dest_object_id>.*[^/]+)$",
            {server.POST: move},
        )
        for prefix in (server.settings.API_ENDPOINT, "")
    ),
    *server.HANDLERS,
)

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main

    main()
