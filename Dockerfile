# gmmlsh REST API: `gmmlsh serve` on a slim Python base, as a non-root user.
#   docker build -t gmmlsh .
#   docker run -p 8000:8000 -v gmmlsh-data:/data -e GMMLSH_DIM=784 gmmlsh
# See docker-compose.yml for Redis-backed replicas and the LMDB profile.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md *.py ./
COPY core ./core
COPY index ./index
COPY service ./service
# The README's install step, verbatim (CI exercising the README exercises this).
RUN pip install .

# Non-root; /data (an index) and /snapshots (a sharded layout's shared snapshots) are created
# here so that named volumes mounted on them are writable by the user.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin gmmlsh \
    && mkdir -p /data /snapshots \
    && chown gmmlsh:gmmlsh /data /snapshots
USER gmmlsh
WORKDIR /home/gmmlsh

# Kernels are compiled here, at image build time, as this user: numba caches them in its
# home (~/.cache/gmmlsh/numba), so containers start without compiling.
ENV GMMLSH_INDEX=/data/index
RUN python -m gmmlsh.index.compile

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["gmmlsh", "serve", "--host", "0.0.0.0", "--port", "8000"]
