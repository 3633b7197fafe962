"""A real S3-API server for the remote tests: moto's standalone server (`python -m moto.server`, as s3fs's
own test suite runs it), started as its own process on a free loopback port and spoken to over HTTP by
s3fs exactly as a user's bucket is; and `Proxy`, a TCP relay in front of it, run as its own process too,
that a test stops and starts again: an outage seen from the client (connections refused), while the
server keeps its objects (moto's are in memory: stopping the server itself would lose them).

    python tests/s3server.py proxy LISTEN_PORT TARGET_PORT    (the relay, until killed)
"""

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port, proc, timeout=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server process exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


class Server:
    """moto's S3 server in its own process. `env`: what a process needs to use it through s3fs (the
    endpoint, as AWS_ENDPOINT_URL, which botocore reads, and keys). `auth=True`: the server checks
    credentials (moto's IAM: the keys of a user this object creates first, `self.keys`). `nice`: the
    server's niceness (a benchmark's server on the training machine's cores takes what training leaves)."""

    def __init__(self, auth=False, nice=0):
        self.port = free_port()
        env = dict(os.environ, **KEYS)
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"  # create a user, its key and its policy; then check every request
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,  # a bench: the server's work, not the client's
        )
        _wait_listening(self.port, self.proc)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.keys = dict(KEYS)
        if auth:
            self.keys.update(self._user())

    def _user(self) -> dict:
        import json

        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, **_boto(KEYS))
        iam.create_user(UserName="trainer")
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def env(self, endpoint=None, **override) -> dict:
        return {**self.keys, "AWS_ENDPOINT_URL": endpoint or self.endpoint, **override}

    def fs(self, endpoint=None):
        "An s3fs file system on this server, for the test's own looks at the bucket."
        import s3fs

        e = self.env(endpoint)
        return s3fs.S3FileSystem(
            key=e["AWS_ACCESS_KEY_ID"],
            secret=e["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=e["AWS_ENDPOINT_URL"],
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def multipart_uploads(self, bucket) -> list:
        "The multipart uploads in progress in `bucket` (an upload of a big file, not yet complete)."
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, **_boto(self.keys))
        return s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def _boto(keys) -> dict:
    return dict(
        aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
        region_name=keys["AWS_DEFAULT_REGION"],
    )


class Proxy:
    "The relay process in front of `target_port`, on a port of its own that stays the same across `stop`/`start`."

    def __init__(self, target_port):
        self.port, self.target = free_port(), target_port
        self.proc = None
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "proxy", str(self.port), str(self.target)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_listening(self.port, self.proc)

    def stop(self):
        "Kills the relay (its open connections die with it): the server is unreachable until `start`."
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


async def _relay(listen_port, target_port):
    async def pipe(reader, writer):
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def handle(cr, cw):
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            cw.close()
            return
        await asyncio.gather(pipe(cr, sw), pipe(sr, cw))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, reuse_address=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__" and sys.argv[1] == "proxy":
    asyncio.run(_relay(int(sys.argv[2]), int(sys.argv[3])))
