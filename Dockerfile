# The embedcar image used by docker-compose.yml (sidecar, catalog job, demo). The model directory
# and indexes are mounted as volumes; `embedcar model prepare` fills them on first start.
FROM python:3.11-slim
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir -c constraints.txt . \
 && pip install --no-cache-dir --no-deps nvidia-pytriton==0.7.0
ENTRYPOINT ["embedcar"]
