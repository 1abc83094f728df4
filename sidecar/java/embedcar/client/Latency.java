package embedcar.client;

import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.function.IntConsumer;

/**
 * What one query's embedding call costs a JVM caller, end to end: the gRPC client (a Vespa
 * component, a search plugin) and the JDK HttpClient on the OpenAI-compatible route (Solr's
 * text-to-vector module through LangChain4j). Sequential calls, one text each, after a warm-up;
 * "miss" texts are all distinct (the sidecar computes each), "hit" repeats one (its cache answers).
 * "grpc_stream" sends the gRPC client's requests as messages on one open Stream call.
 * Prints P50/P95 in milliseconds as JSON.
 *
 * <pre>java -cp CLASSPATH embedcar.client.Latency HOST:PORT http://HOST:PORT/v1/embeddings MODEL KEY N</pre>
 */
public final class Latency {

    private Latency() {}

    public static void main(String[] args) throws Exception {
        String target = args[0];
        URI url = URI.create(args[1]);
        String model = args[2];
        String key = args[3];
        int n = Integer.parseInt(args[4]);
        long run = System.nanoTime(); // distinct texts per run: earlier runs' texts are in the cache
        HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(15)).build();
        StringBuilder out = new StringBuilder("{");
        try (EmbedcarClient grpc = new EmbedcarClient(target, key)) {
            IntConsumer grpcMiss = i -> grpc.embed(List.of("grpc " + run + " query " + i), Duration.ofSeconds(5));
            IntConsumer grpcHit = i -> grpc.embed(List.of("greek yogurt"), Duration.ofSeconds(5));
            IntConsumer streamMiss = i -> grpc.embedOnStream(List.of("stream " + run + " query " + i),
                    Duration.ofSeconds(5));
            IntConsumer streamHit = i -> grpc.embedOnStream(List.of("greek yogurt"), Duration.ofSeconds(5));
            IntConsumer httpMiss = i -> post(http, url, key, model, "http " + run + " query " + i);
            IntConsumer httpHit = i -> post(http, url, key, model, "greek yogurt");
            out.append("\"grpc_miss\":").append(time(grpcMiss, n, -n));
            out.append(",\"grpc_stream_miss\":").append(time(streamMiss, n, -n));
            out.append(",\"grpc_hit\":").append(time(grpcHit, n, 0));
            out.append(",\"grpc_stream_hit\":").append(time(streamHit, n, 0));
            out.append(",\"jdk_http_miss\":").append(time(httpMiss, n, -n));
            out.append(",\"jdk_http_hit\":").append(time(httpHit, n, 0));
        }
        System.out.println(out.append('}'));
    }

    /** Warm-up calls numbered from `warmupFrom`, then n timed ones numbered 0..n-1. */
    private static String time(IntConsumer call, int n, int warmupFrom) {
        for (int i = 0; i < Math.min(n, 50); i++) {
            call.accept(warmupFrom - 1 - i);
        }
        List<Double> ms = new ArrayList<>(n);
        for (int i = 0; i < n; i++) {
            long t = System.nanoTime();
            call.accept(i);
            ms.add((System.nanoTime() - t) / 1e6);
        }
        double[] s = ms.stream().mapToDouble(Double::doubleValue).sorted().toArray();
        return String.format("{\"p50_ms\":%.3f,\"p95_ms\":%.3f,\"n\":%d}", s[s.length / 2],
                s[(int) Math.ceil(s.length * 0.95) - 1], n);
    }

    private static void post(HttpClient http, URI url, String key, String model, String text) {
        String body = "{\"model\":\"" + model + "\",\"input\":[\"" + text + "\"]}";
        HttpRequest request = HttpRequest.newBuilder(url).timeout(Duration.ofSeconds(5))
                .header("Content-Type", "application/json").header("Authorization", "Bearer " + key)
                .POST(HttpRequest.BodyPublishers.ofString(body)).build();
        try {
            HttpResponse<String> r = http.send(request, HttpResponse.BodyHandlers.ofString());
            if (r.statusCode() != 200) {
                throw new IllegalStateException("HTTP " + r.statusCode() + ": " + r.body());
            }
        } catch (java.io.IOException e) {
            throw new java.io.UncheckedIOException(e);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new IllegalStateException(e);
        }
    }
}
