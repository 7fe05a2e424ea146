"""The ``filesystem://`` broker (the demo's embedded default, never production) with atomic
publishes: ``broker_transport = "fsbroker:Transport"`` (celeryconfig sets it for that URL).

kombu's filesystem transport creates a message file in the folder its consumers list, under
its final name, and only then writes it. A consumer polling in between moves and reads an
empty or partial file, and its worker stops on the JSONDecodeError ("Unrecoverable error"); a
publisher killed in between leaves such a file behind for good. Here a message is written
under a name no consumer matches (``.<name>.part``) and renamed to its final name once
complete: a rename within one folder is atomic on POSIX, so a consumer sees a whole message
or none."""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):  # type: ignore[misc]
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"  # kombu's own naming
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):  # type: ignore[misc]
    Channel = Channel
