"""gcp-storage-emulator with GCS's generation preconditions, which it ignores: an object insert or
delete that carries ifGenerationMatch (0: only if the object does not exist) is refused with 412
unless the object's generation is that one, checked and applied in one step, as GCS does. The run
folder's gs:// lock (lock.py) relies on them; tests/helpers.py's GCSEmulator starts this instead of
the plain emulator.

usage: python tests/gcs_emulator.py start --host 127.0.0.1 --port PORT ...   (gcp-storage-emulator's
arguments)
"""

import threading
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_ONE_AT_A_TIME = threading.Lock()  # the server answers each request in a thread


def _with_precondition(handler):
    def handle(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        if not wanted:
            return handler(request, response, storage, *args, **kwargs)
        data = request.data if isinstance(request.data, dict) else {}
        name = (
            (request.params or {}).get("object_id")
            or (request.query.get("name") or [None])[0]
            or data.get("meta", {}).get("name")
        )
        with _ONE_AT_A_TIME:
            try:
                generation = str(
                    storage.get_file_obj(request.params["bucket_name"], name)["generation"]
                )
            except NotFound:
                generation = "0"
            if generation != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                return None
            return handler(request, response, storage, *args, **kwargs)

    return handle


objects.insert = _with_precondition(objects.insert)
objects.delete = _with_precondition(objects.delete)

if __name__ == "__main__":
    # after the patch: its server looks the handlers up on import
    from gcp_storage_emulator.__main__ import main

    main()
