"""`rollstream broker start|stop|status`: a local Apache Kafka (KRaft) on loopback for development and tests."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from rollstream.cli._common import examples
from rollstream.infra.broker import (
    BrokerSpec,
    broker_status,
    client_config_files,
    default_data_dir,
    default_kafka_version,
    ensure_kafka_jars,
    start_broker,
    stop_broker,
)

app = typer.Typer(help="Run a local Apache Kafka broker (KRaft mode, loopback only).", no_args_is_help=True,
                  epilog=examples("rollstream broker start", "rollstream broker status", "rollstream broker stop"))

DataDirOpt = Annotated[Path | None, typer.Option(
    "--data-dir", help="Where the broker keeps its logs, config and pids (default ~/.rollstream/broker).")]


@app.command("start", epilog=examples("rollstream broker start",
                                             "rollstream broker start --port 19092 --nodes 3",
                                             "rollstream broker start --sasl --tls",
                                             "rollstream broker start --kafka-version 3.3.2 --data-dir /tmp/k33"))
def start(
    port: Annotated[int, typer.Option(help="Client port of the first node (node i listens on port+i-1).")] = 9092,
    controller_port: Annotated[int | None, typer.Option(
        help="KRaft controller port of the first node (node i's controller listens on P+i-1); "
             "default port+100.")] = None,
    nodes: Annotated[int, typer.Option(help="1, or 3 for a replicated KRaft cluster on this host.")] = 1,
    data_dir: DataDirOpt = None,
    heap_mb: Annotated[int, typer.Option(help="JVM heap per node in MiB.")] = 512,
    timeout: Annotated[float, typer.Option(help="Seconds to wait until the broker serves.")] = 120.0,
    sasl: Annotated[bool, typer.Option(
        "--sasl", help="Secure it: SASL/SCRAM-SHA-512, ACLs (StandardAuthorizer), users admin/producer/trainer; "
                       "writes a --kafka-config file per user into the data dir. A data dir keeps its mode.")] = False,
    tls: Annotated[bool, typer.Option(
        "--tls", help="Encrypt every listener with certificates of a local CA made at start (SASL_SSL with --sasl, "
                      "else SSL); the client config files carry ssl.ca.location.")] = False,
    mtls: Annotated[bool, typer.Option(
        "--mtls", help="Mutual TLS (implies --tls): clients need a certificate of the local CA, whose CN is their "
                       "principal (User:admin, User:producer, User:trainer); ACLs apply to it.")] = False,
    kafka_version: Annotated[str | None, typer.Option(
        help="Apache Kafka release to run, 3.3.0 or newer (its jars resolved by Maven once); default "
             "$ROLLSTREAM_KAFKA_VERSION, else the pinned one. A data dir never moves to an older one.")] = None,
) -> None:
    """Start the broker in the background (fetching its jars with Maven on first use), wait until a
    client can produce and consume, then print the bootstrap address as the last line."""
    if nodes not in (1, 3):
        raise typer.BadParameter("--nodes must be 1 or 3")
    node_count: Literal[1, 3] = 1 if nodes == 1 else 3
    spec = BrokerSpec(port=port, nodes=node_count, data_dir=data_dir or default_data_dir(), heap_mb=heap_mb,
                      controller_port=controller_port, sasl=sasl, tls=tls or mtls, mtls=mtls,
                      kafka_version=kafka_version or default_kafka_version())
    ensure_kafka_jars(version=spec.kafka_version, progress=lambda message: typer.echo(message, err=True))
    bootstrap = start_broker(spec, timeout=timeout)
    if spec.sasl or spec.tls:
        _print_client_configs(spec.data_dir, spec.sasl, spec.tls, spec.mtls)
    typer.echo(bootstrap)


def _print_client_configs(data_dir: Path, sasl: bool, tls: bool, mtls: bool) -> None:
    files = client_config_files(data_dir)
    transport = "mutual TLS (a client certificate's CN is its principal)" if mtls else "TLS" if tls else ""
    mode = " over ".join(m for m in ("SASL/SCRAM-SHA-512" if sasl else "", transport) if m)
    typer.echo(f"{mode}{' with ACLs' if sasl or mtls else ''}; client configs (pass one with --kafka-config FILE):",
               err=True)
    for name, path in files.items():
        role = " (super user: topics create, rollstream acls --apply)" if name == "admin" else ""
        typer.echo(f"  {name}: {path}{role}", err=True)
    if tls:
        typer.echo(f"  CA certificate: {data_dir / 'tls' / 'ca.pem'}", err=True)
    if not (sasl or mtls):
        return
    typer.echo("grant producer and trainer their ACLs: rollstream acls --namespace NS --producer-principal "
               "User:producer --trainer-principal User:trainer --apply --kafka-config "
               f"{files.get('admin', data_dir / 'admin.properties')}", err=True)


@app.command("stop", epilog=examples("rollstream broker stop --data-dir ~/.rollstream/broker"))
def stop(data_dir: DataDirOpt = None) -> None:
    """Stop exactly the broker processes started with this data dir."""
    stopped = stop_broker(data_dir or default_data_dir())
    typer.echo("stopped" if stopped else "no broker was running")


@app.command("status", epilog=examples("rollstream broker status"))
def status(data_dir: DataDirOpt = None) -> None:
    """Say whether the broker of this data dir runs, and where."""
    st = broker_status(data_dir or default_data_dir())
    if st.running:
        typer.echo(f"running: {st.bootstrap} (Kafka {st.kafka_version}; controller ports "
                   f"{', '.join(map(str, st.controller_ports))}; pids {', '.join(map(str, st.pids))}; "
                   f"log {st.log_path})")
        if st.sasl or st.tls:
            _print_client_configs(st.data_dir, st.sasl, st.tls, st.mtls)
    else:
        typer.echo(f"not running (data dir {st.data_dir})")
        raise typer.Exit(1)
