#!/bin/bash
# The audit image's entry point for Spark on Kubernetes: the driver and executor pods that
# spark-submit (or the spark-operator) creates start the image with `driver ...` or
# `executor`, and the settings in SPARK_* variables. Anything else runs as given.
set -euo pipefail
SPARK_HOME=${SPARK_HOME:?}
case "${1:-}" in
driver)
    shift
    exec "$SPARK_HOME/bin/spark-submit" \
        --conf "spark.driver.bindAddress=${SPARK_DRIVER_BIND_ADDRESS}" \
        --conf "spark.executorEnv.SPARK_DRIVER_POD_IP=${SPARK_DRIVER_BIND_ADDRESS}" \
        --deploy-mode client "$@"
    ;;
executor)
    exec java ${SPARK_EXECUTOR_JAVA_OPTS:-} \
        -Xms"${SPARK_EXECUTOR_MEMORY}" -Xmx"${SPARK_EXECUTOR_MEMORY}" \
        -cp "${SPARK_CLASSPATH:-}:$SPARK_HOME/jars/*" \
        org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
        --driver-url "${SPARK_DRIVER_URL}" --executor-id "${SPARK_EXECUTOR_ID}" \
        --cores "${SPARK_EXECUTOR_CORES}" --app-id "${SPARK_APPLICATION_ID}" \
        --hostname "${SPARK_EXECUTOR_POD_IP}" \
        --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID:-0}" \
        --podName "${SPARK_EXECUTOR_POD_NAME:-}"
    ;;
*)
    exec "$@"
    ;;
esac
