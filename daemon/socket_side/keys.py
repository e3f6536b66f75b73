"""`councild keys`: make the CURVE key pair a TCP endpoint needs, and load it back.

The daemon's secret key goes to a file readable by its owner only (0600); the public key
(Z85 text, 40 characters) goes to a 0644 file beside it and to stdout: it is what the
operator hands to clients (``Client(curve_server_key=...)``). Point the daemon at the
secret file with ``curve_secret_key_file`` in its config.

File format (the one ``zmq.auth.create_certificates`` writes, so either tool's files load):

    # councild CURVE secret key: keep this file private (0600)
    curve
        public-key = "<40 chars Z85>"
        secret-key = "<40 chars Z85>"

``load_secret_key`` also accepts a file holding only the 40-character secret key.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
from pathlib import Path

import zmq

from ..exits import EXIT_CANTCREAT

SECRET_NAME = "councild.key_secret"
PUBLIC_NAME = "councild.key"

_Z85_KEY = r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}"


class KeyFileError(ValueError):
    """A key file that is missing, malformed or readable by others."""


def _write(path: Path, text: str, mode: int) -> None:
    # Create with the final mode (O_EXCL: never overwrite a key by accident), so the secret
    # is never readable by others, not even for an instant.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)  # the umask may have narrowed it


def generate(out_dir: str | os.PathLike, force: bool = False) -> tuple[Path, Path, str]:
    """Make a key pair in ``out_dir``; return (secret path, public path, public key)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret_path, public_path = out / SECRET_NAME, out / PUBLIC_NAME
    if force:
        secret_path.unlink(missing_ok=True)
        public_path.unlink(missing_ok=True)
    elif secret_path.exists() or public_path.exists():
        raise FileExistsError(f"{secret_path} or {public_path} already exists (use --force to replace)")
    public, secret = zmq.curve_keypair()
    pub, sec = public.decode("ascii"), secret.decode("ascii")
    _write(secret_path,
           "# councild CURVE secret key: keep this file private (0600)\n"
           f'curve\n    public-key = "{pub}"\n    secret-key = "{sec}"\n', 0o600)
    _write(public_path,
           "# councild CURVE public key: give it to clients (Client(curve_server_key=...))\n"
           f'curve\n    public-key = "{pub}"\n', 0o644)
    return secret_path, public_path, pub


def load_secret_key(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a secret key file. Refuses a file that group or
    others can read: a leaked secret key lets anyone impersonate the daemon."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text()
    except OSError as exc:
        raise KeyFileError(f"cannot read the CURVE secret key file {p}: {exc.strerror}") from None
    if sys.platform != "win32" and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"the CURVE secret key file {p} is accessible by group or others "
                           f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
    secret = re.search(rf'secret-key\s*=\s*"({_Z85_KEY})"', text)
    if secret is None:
        bare = text.strip()
        if re.fullmatch(_Z85_KEY, bare):
            secret_key = bare.encode("ascii")
        else:
            raise KeyFileError(f"{p} holds no CURVE secret key (make one with `councild keys`)")
    else:
        secret_key = secret.group(1).encode("ascii")
    try:
        public_key = zmq.curve_public(secret_key)
    except (zmq.ZMQError, ValueError) as exc:
        raise KeyFileError(f"{p}: not a valid CURVE secret key: {exc}") from None
    public = re.search(rf'public-key\s*=\s*"({_Z85_KEY})"', text)
    if public is not None and public.group(1).encode("ascii") != public_key:
        raise KeyFileError(f"{p}: its public-key does not match its secret-key")
    return public_key, secret_key


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="councild keys",
        description="Generate a CURVE key pair for serving a tcp:// endpoint. Writes "
        f"{SECRET_NAME} (0600: set curve_secret_key_file to it) and {PUBLIC_NAME} (0644), and "
        "prints the public key: give that to clients (Client(curve_server_key=...)).",
    )
    p.add_argument("--out", default=None,
                   help="folder for the key files (default: the per-user config folder, "
                   "$XDG_CONFIG_HOME/councild or ~/.config/councild)")
    p.add_argument("--force", action="store_true", help="replace existing key files")
    return p


def _default_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "councild"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out) if args.out else _default_dir()
    try:
        secret_path, public_path, public = generate(out, force=args.force)
    except (FileExistsError, OSError) as exc:
        print(f"councild keys: {exc}", file=sys.stderr)
        return EXIT_CANTCREAT
    print(f"secret key: {secret_path} (0600; set curve_secret_key_file = \"{secret_path}\")", file=sys.stderr)
    print(f"public key: {public_path}", file=sys.stderr)
    print(public)
    return 0


if __name__ == "__main__":
    sys.exit(main())
