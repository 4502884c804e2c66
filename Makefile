# Everything runs from a project-local virtualenv (.venv) that the first target creates and that
# is reinstalled only when pyproject.toml changes. Python >= 3.11, Java 17 (Spark, Kafka) and
# Maven must be on the machine; everything else comes from PyPI and Maven Central.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup maven kafka-jars iceberg-jars dev test lint typecheck unit bench clean redis-server libfaketime gcc postgresql podman debootstrap image

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

## Jars fetched by Maven: tools/NAME/pom.xml's dependencies copied into .deps/NAME, again only
## when that pom changes. Maven (Debian's package) is installed with apt-get when missing and
## we are root.
##   .deps/kafka: a KRaft Kafka (`danube-ingest kafka`, the Kafka test fixtures);
##   .deps/iceberg: Spark's Iceberg runtime and the SQLite and PostgreSQL JDBC drivers (Spark
##   SQL reads the topics' Iceberg tables by name with them).
KAFKA_STAMP := .deps/kafka/.fetched-stamp
ICEBERG_STAMP := .deps/iceberg/.fetched-stamp

maven:
	@command -v mvn >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq maven >/dev/null; } \
		|| { echo "mvn is needed to fetch the jars: apt-get install maven" >&2; exit 1; }

.deps/%/.fetched-stamp: tools/%/pom.xml | maven
	rm -rf .deps/$*
	mvn -q -B -f tools/$*/pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/.deps/$*
	touch $@

kafka-jars: $(KAFKA_STAMP)

iceberg-jars: $(ICEBERG_STAMP)

setup: $(STAMP) kafka-jars iceberg-jars

## redis-server (Debian's package): the Redis Streams peer of the benchmarks, and of the
## benchmark runner's test. Installed with apt-get when missing and we are root.
redis-server:
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; } \
		|| { echo "redis-server is needed (the tests start one): apt-get install redis-server" >&2; exit 1; }

## PostgreSQL (Debian's package): the Iceberg catalog database the tests start for several
## machines' catalogs (danube_ingest.testing.LocalPostgres runs its own server).
postgresql:
	@test -n "$$(ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null)" || command -v initdb >/dev/null \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq \
		&& apt-get install -y -qq postgresql >/dev/null; } \
		|| { echo "PostgreSQL is needed (a test starts one): apt-get install postgresql" >&2; exit 1; }

## libfaketime (Debian's package): the wall-clock-jump fault test runs the daemon under it.
libfaketime:
	@test -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 || { [ "$$(id -u)" = 0 ] \
		&& command -v apt-get >/dev/null && apt-get update -qq \
		&& apt-get install -y -qq libfaketime >/dev/null; } \
		|| { echo "libfaketime is needed (a fault test uses it): apt-get install libfaketime" >&2; exit 1; }

## podman and runc (Debian's packages): the container tests run images built here through
## testcontainers (danube_ingest.containers; no Docker engine, no registry needed).
podman:
	@{ command -v podman >/dev/null && command -v runc >/dev/null; } || { [ "$$(id -u)" = 0 ] \
		&& command -v apt-get >/dev/null && apt-get update -qq \
		&& apt-get install -y -qq podman runc >/dev/null; } \
		|| { echo "podman and runc are needed (container tests): apt-get install podman runc" >&2; exit 1; }

## debootstrap (Debian's package): the image's root filesystem (tools/image/build.sh).
debootstrap:
	@command -v debootstrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; } \
		|| { echo "debootstrap is needed (make image): apt-get install debootstrap" >&2; exit 1; }

## The danube-ingest image, localhost/danube-ingest:<digest> in podman's store (prints the tag):
## Debian bookworm's packages, the project's own wheel, the Maven jars; see docs/containers.md.
image: setup podman debootstrap
	@bash tools/image/build.sh

## gcc (Debian's package): the I/O-error tests build their LD_PRELOAD shim (tests/faults/failio.c).
gcc:
	@command -v gcc >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq gcc >/dev/null; } \
		|| { echo "gcc is needed (I/O-error tests build a shim): apt-get install gcc" >&2; exit 1; }

## The whole system on embedded defaults: local etcd, broker on 127.0.0.1:6650, data under ./data.
## Options go through ARGS, e.g. make dev ARGS="--dagster-port 3001" (danube-ingest dev --help).
dev: setup
	$(BIN)/danube-ingest dev $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

unit: setup redis-server libfaketime gcc postgresql podman debootstrap
	$(BIN)/pytest -q -p no:cacheprovider --durations=30

## The full test suite, as CI runs it: lint, type check, every test (real etcd, s3, Spark...).
test: lint typecheck unit

bench: setup redis-server
	for b in benchmarks/*.py; do case $$b in */_*) ;; *) $(BIN)/python $$b || exit 1;; esac; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
