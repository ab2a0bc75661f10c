# mlaverify: server and client in a slim runtime image.
#
#   CPU image (Debian 12 only; what scripts/image.sh builds and tests):
#     podman build -t mlaverify:cpu .
#   GPU image (a CUDA 13 devel image for the build, its runtime image to run;
#   the base must offer the Debian/Ubuntu packages of install_deps.sh --build):
#     podman build -t mlaverify:gpu \
#       --build-arg BUILD_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu24.04 \
#       --build-arg RUNTIME_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04 .
#
# The runtime stage holds the two binaries, the shared libraries they load
# that the base lacks (copied by scripts/bundle.sh) and curl for the health
# check; it runs as an unprivileged user.
ARG BUILD_IMAGE=debian:12
ARG RUNTIME_IMAGE=debian:12

FROM ${BUILD_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive
COPY scripts/install_deps.sh /src/scripts/install_deps.sh
RUN /src/scripts/install_deps.sh --build && rm -rf /var/lib/apt/lists/*
COPY . /src
# Release build of the two binaries only (no tests or benchmarks); CUDA code
# when the base image has nvcc, for the H200 (sm_90) and production (sm_120).
RUN cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES="90-real;120" \
    && cmake --build /build --target mlaverify-server mlaverify-client \
    && /src/scripts/bundle.sh /opt/mlaverify /build/server/mlaverify-server \
         /build/client/mlaverify-client

FROM ${RUNTIME_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin mlaverify
COPY --from=build /opt/mlaverify /opt/mlaverify
ENV LD_LIBRARY_PATH=/opt/mlaverify/lib PATH=/opt/mlaverify/bin:$PATH
USER 10001
# gRPC (VerifyService, grpc.health.v1, reflection) and the admin HTTP port
# (/metrics, /healthz, /readyz).
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD curl -fsS http://127.0.0.1:9090/healthz || exit 1
ENTRYPOINT ["/opt/mlaverify/bin/mlaverify-server"]
CMD ["--listen", "0.0.0.0:50051", "--admin-host", "0.0.0.0", "--admin-port", "9090", \
     "--backend", "auto"]
