"""Build the Java gRPC client (sidecar/java/) from client/embedcar_client/proto with Debian's packages; no Maven.

A search engine on the JVM (an Elasticsearch/OpenSearch/Solr plugin, a Vespa component) calls the
sidecar through `embedcar.client.EmbedcarClient`; `embedcar.client.Example` shows embed, search,
deadline and API key. The build is three steps, the same by hand:

    protoc -Iclient --java_out=OUT --plugin=protoc-gen-grpc-java=/usr/bin/grpc_java_plugin \\
           --grpc-java_out=OUT client/embedcar_client/proto/embedcar.proto
    javac -d CLASSES -cp "$(python -m sidecar.java_client --classpath)" OUT/embedcar/v1/*.java \\
          sidecar/java/embedcar/client/*.java
    java -cp "CLASSES:$(python -m sidecar.java_client --classpath)" embedcar.client.Example HOST:PORT KEY TEXT...

`python -m sidecar.java_client --run embedcar.client.Example HOST:PORT KEY TEXT...` builds and runs;
`build_java_client()` does the build into var/java-client/<hash of the sources>/ (reused while the
sources are unchanged); `java_unavailable_reason()` says what is missing (`make java` installs it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import embedcar_client.proto

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SOURCES = sorted((HERE / "java").rglob("*.java"))
# The .proto ships in the client's distribution (embedcar-client), checked out or installed; its include
# root is the one the Python stubs are generated with (embedcar_client/proto/generate.py).
PROTO = Path(embedcar_client.proto.__file__).resolve().parent / "embedcar.proto"
PROTO_ROOT = PROTO.parents[2]
JARS_DIR = Path("/usr/share/java")
PLUGIN = Path("/usr/bin/grpc_java_plugin")
BUILD_DIR = Path("var/java-client")
# Debian bookworm: libgrpc-java declares none of its runtime jars as dependencies, hence the list.
# geronimo-annotation: the javax.annotation.Generated that grpc-java 1.41's stubs carry (Java 17 has none).
DEBIAN_PACKAGES = ("openjdk-17-jdk-headless", "protobuf-compiler", "protobuf-compiler-grpc-java-plugin",
                   "libgrpc-java", "libprotobuf-java", "libnetty-java", "libperfmark-java",
                   "libgeronimo-annotation-1.3-spec-java")
JARS = ("grpc-api", "grpc-context", "grpc-core", "grpc-netty", "grpc-protobuf", "grpc-protobuf-lite", "grpc-stub",
        "protobuf", "guava", "perfmark-api", "netty-buffer", "netty-codec", "netty-codec-http", "netty-codec-http2",
        "netty-common", "netty-handler", "netty-resolver", "netty-transport", "netty-transport-native-unix-common",
        "geronimo-annotation-1.3-spec")


def classpath() -> str:
    return os.pathsep.join(str(JARS_DIR / f"{name}.jar") for name in JARS)


def java_unavailable_reason() -> str | None:
    """None when the client can be built here, else what is missing and how to get it."""
    missing = [tool for tool in ("javac", "java", "protoc") if shutil.which(tool) is None]
    missing += [str(p) for p in (PLUGIN, *(JARS_DIR / f"{n}.jar" for n in JARS)) if not p.exists()]
    if missing:
        return (f"the Java client needs {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: "
                f"`make java`, or apt-get install {' '.join(DEBIAN_PACKAGES)}")
    return None


def _source_hash() -> str:
    h = hashlib.sha256()
    for path, name in ((PROTO, PROTO.relative_to(PROTO_ROOT)), *((p, p.relative_to(ROOT)) for p in SOURCES)):
        h.update(name.as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def build_java_client(build_dir: Path = BUILD_DIR) -> Path:
    """Compile the generated stubs and the client; returns the classes folder (reused if built)."""
    reason = java_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    out = (build_dir / _source_hash()).resolve()
    classes = out / "classes"
    if (classes / "embedcar" / "client" / "Example.class").is_file():
        return classes
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        gen, cls = Path(tmp) / "gen", Path(tmp) / "classes"
        gen.mkdir()
        _run(["protoc", f"-I{PROTO_ROOT}", f"--java_out={gen}", f"--plugin=protoc-gen-grpc-java={PLUGIN}",
              f"--grpc-java_out={gen}", str(PROTO)])
        _run(["javac", "-nowarn", "-encoding", "UTF-8", "-d", str(cls), "-cp", classpath(),
              *map(str, sorted(gen.rglob("*.java"))), *map(str, SOURCES)])
        out.mkdir(exist_ok=True)
        cls.replace(classes)  # one rename: a reader sees all the classes or none
    return classes


def java_command(classes: Path, main: str, *args: str) -> list[str]:
    return ["java", "-cp", f"{classes}{os.pathsep}{classpath()}", main, *args]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def main(argv: list[str]) -> int:
    """`--check`: exit 1 saying what is missing; `--packages`: the Debian packages; `--classpath`:
    the jars; `--run MAIN ARGS...`: build, then run that class; no flag: build and print the classes folder."""
    if argv[:1] == ["--run"] and len(argv) > 1:
        os.execvp("java", java_command(build_java_client(), argv[1], *argv[2:]))
    if argv == ["--check"]:
        reason = java_unavailable_reason()
        print(reason or "ok")
        return 1 if reason else 0
    if argv == ["--packages"]:
        print(" ".join(DEBIAN_PACKAGES))
    elif argv == ["--classpath"]:
        print(classpath())
    else:
        print(build_java_client())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
