"""The library notices that flowgrpo quiets: :mod:`flowgrpo.notices` (installed when ``flowgrpo`` is imported), under
the name the launch script's modules and the tools used before."""

from ..notices import QUIET_NOTICES, NoticeFilter, quiet_library_notices

__all__ = ["QUIET_NOTICES", "NoticeFilter", "quiet_library_notices"]
