# mlaverify: server and client in a slim runtime image.
#
#   CPU image (Debian 12; what scripts/image.sh builds and tests; the last
#   stage, `cpu`, is the default target):
#     podman build -t mlaverify:cpu --build-arg REVISION=$(git rev-parse HEAD) .
#   GPU image (a CUDA 13 devel image for the build, its base image to run;
#   the build base must offer the packages of install_deps.sh --build, and
#   the runtime base must be the same distribution release; this variant has
#   not been built yet, for want of a build machine with the CUDA images):
#     podman build -t mlaverify:gpu --target gpu \
#       --build-arg BUILD_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu24.04 \
#       --build-arg RUNTIME_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04 .
#
# The runtime stage holds the two binaries (stripped) and the distribution's
# packages of the shared libraries they load, installed with apt: the build
# stage asks dpkg which package owns each library `ldd` lists
# (/opt/mlaverify/runtime-packages), so one Dockerfile names Debian 12's
# packages or Ubuntu 24.04's (the CUDA bases) with no list to keep,
# scanners see every library, and a rebuild on an updated base picks up the
# distribution's fixes. No library is copied and
# LD_LIBRARY_PATH is unset. Only the GPU driver's libraries (libcuda,
# libnvidia-*) are left out: the container runtime mounts them from the host.
# No curl: the health check speaks HTTP to /readyz with bash's /dev/tcp.
# It runs as an unprivileged user.
ARG BUILD_IMAGE=debian:12
ARG RUNTIME_IMAGE=debian:12

FROM ${BUILD_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive
COPY scripts/install_deps.sh /src/scripts/install_deps.sh
RUN /src/scripts/install_deps.sh --build && rm -rf /var/lib/apt/lists/*
COPY . /src
# The context carries no .git: the binaries' --version takes the commit from
# here (scripts/image.sh passes it).
ARG REVISION=unknown
# Release build of the two binaries only (no tests or benchmarks); CUDA code
# when the base image has nvcc, for the H200 (sm_90) and production (sm_120).
RUN cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES="90-real;120" -DMLAVERIFY_SOURCE_REVISION="${REVISION}" \
    && cmake --build /build --target mlaverify-server mlaverify-client
# The binaries, stripped, and the packages that own the libraries they load.
# A library no package owns (other than the driver's) stops the build: the
# runtime stage could not install it.
RUN mkdir -p /opt/mlaverify/bin \
    && for b in server/mlaverify-server client/mlaverify-client; do \
         strip -o /opt/mlaverify/bin/"${b#*/}" /build/"$b"; done \
    && ldd /build/server/mlaverify-server /build/client/mlaverify-client \
       | awk '$2 == "=>" {print $1, $3}' | sort -u > /tmp/libraries \
    && while read -r name path; do \
         case $name in libcuda.so*|libnvidia*) continue ;; esac; \
         owner=$(dpkg-query -S "$path" 2>/dev/null \
                 || dpkg-query -S "$(readlink -f "$path")" 2>/dev/null) \
           || { echo "no package owns $name ($path)" >&2; exit 1; }; \
         echo "${owner%%: *}" | tr ',' '\n' | sed 's/^ *//; s/:.*//'; \
       done < /tmp/libraries > /tmp/packages \
    && sort -u /tmp/packages > /opt/mlaverify/runtime-packages \
    && echo "runtime packages:" $(cat /opt/mlaverify/runtime-packages)

FROM ${RUNTIME_IMAGE} AS runtime
# Set with --build-arg (scripts/image.sh passes the first two): the project
# version (CMakeLists.txt), the git commit built (also what the binaries'
# --version reports, through the build stage's REVISION) and the repository's
# URL (the project publishes none yet). The licence is the repository's
# (LICENSE: Apache-2.0).
ARG VERSION=unknown
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="mlaverify" \
      org.opencontainers.image.description="MLA verify-attention service (gRPC server and client; CUDA or CPU backend)" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
COPY --from=build /opt/mlaverify/runtime-packages /opt/mlaverify/runtime-packages
# nghttp2-proxy: nghttpx, the HTTP/2 front for untrusted networks
# (deploy/http2-front; run as `nghttpx --conf=/etc/mlaverify-front/nghttpx.conf`).
RUN apt-get update -qq \
    && xargs apt-get install -y -qq --no-install-recommends nghttp2-proxy \
       < /opt/mlaverify/runtime-packages \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin mlaverify
COPY --from=build /opt/mlaverify/bin /opt/mlaverify/bin
COPY deploy/http2-front/nghttpx.conf /etc/mlaverify-front/nghttpx.conf
ENV PATH=/opt/mlaverify/bin:$PATH
USER 10001
# gRPC (VerifyService, grpc.health.v1, reflection) and the admin HTTP port
# (/metrics, /healthz, /readyz).
EXPOSE 50051 9090
# GET /readyz over bash's /dev/tcp; healthy on an HTTP 200 status line: the
# server serves and its gRPC port answers its own health check in time
# (--readiness-grpc-timeout-ms), so a flooded or wedged transport shows as
# unhealthy, and so does a drain or a device fault. The start period covers
# pools and CUDA graphs on 8 GPUs (up to 10 minutes).
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
  CMD ["/bin/bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9090 && printf 'GET /readyz HTTP/1.0\\r\\nHost: 127.0.0.1\\r\\n\\r\\n' >&3 && read -r _ code _ <&3 && [ \"$code\" = 200 ]"]
ENTRYPOINT ["/opt/mlaverify/bin/mlaverify-server"]

# The GPU image (--target gpu) serves on CUDA devices only: started without
# one (no --gpus, no device plugin) it exits at once naming the missing
# device, instead of serving on the CPU at a fraction of the speed.
FROM runtime AS gpu
CMD ["--listen", "0.0.0.0:50051", "--admin-host", "0.0.0.0", "--admin-port", "9090", \
     "--backend", "cuda"]

# The CPU image (the default target): a Debian build has no CUDA toolkit, so
# its server has the CPU backend only, and says so.
FROM runtime AS cpu
CMD ["--listen", "0.0.0.0:50051", "--admin-host", "0.0.0.0", "--admin-port", "9090", \
     "--backend", "cpu"]
