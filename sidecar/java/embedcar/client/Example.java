package embedcar.client;

import embedcar.v1.Embedcar.Hit;
import embedcar.v1.Embedcar.SearchMode;
import io.grpc.StatusRuntimeException;
import java.time.Duration;
import java.util.Arrays;
import java.util.List;

/**
 * What a search node does with {@link EmbedcarClient}: embed shopper queries (unary, and as messages
 * on one open Stream call), search the sidecar's catalog index, give each call a deadline, send its
 * API key. Prints one JSON object (vectors as
 * float32 shortest-repr decimals, so a reader gets the exact values back).
 *
 * <pre>java -cp CLASSPATH embedcar.client.Example 127.0.0.1:50051 API_KEY "greek yogurt" ...</pre>
 */
public final class Example {

    private Example() {}

    public static void main(String[] args) throws Exception {
        if (args.length < 3) {
            System.err.println("usage: Example HOST:PORT API_KEY TEXT...");
            System.exit(2);
        }
        String target = args[0];
        String apiKey = args[1];
        List<String> texts = Arrays.asList(args).subList(2, args.length);
        StringBuilder out = new StringBuilder("{");
        try (EmbedcarClient client = new EmbedcarClient(target, apiKey)) {
            // A typeahead budget: the sidecar answers in a few ms or refuses at once.
            EmbedcarClient.Embeddings e = client.embed(texts, Duration.ofMillis(2000));
            out.append("\"model\":").append(quote(e.model()));
            out.append(",\"dim\":").append(e.vectors()[0].length);
            out.append(",\"embeddings\":[");
            for (int i = 0; i < e.vectors().length; i++) {
                out.append(i == 0 ? "[" : ",[");
                float[] row = e.vectors()[i];
                for (int j = 0; j < row.length; j++) {
                    out.append(j == 0 ? "" : ",").append(Float.toString(row[j]));
                }
                out.append(']');
            }
            out.append("],\"search\":");
            try {
                List<List<Hit>> hits = client.search(texts.subList(0, 1), 3, SearchMode.HYBRID, Duration.ofMillis(2000));
                out.append('[');
                for (int i = 0; i < hits.get(0).size(); i++) {
                    Hit h = hits.get(0).get(i);
                    out.append(i == 0 ? "" : ",").append("{\"id\":").append(quote(h.getId()))
                            .append(",\"title\":").append(quote(h.getFieldsOrDefault("title", "")))
                            .append(",\"legs\":").append(quote(String.join("+", h.getLegsList()))).append('}');
                }
                out.append(']');
            } catch (StatusRuntimeException ex) { // e.g. FAILED_PRECONDITION: the sidecar serves no index
                out.append(quote(ex.getStatus().getCode().name()));
            }
            // The same texts as messages on one open Stream call (several: the stream stays open).
            out.append(",\"stream_embeddings\":[");
            for (int round = 0; round < 3; round++) {
                float[][] v = client.embedOnStream(texts, Duration.ofMillis(2000)).vectors();
                out.append(round == 0 ? "" : ",").append(Arrays.deepEquals(v, e.vectors()) ? "\"same\"" : "\"differ\"");
            }
            out.append(']');
            // A deadline already spent: the call ends DEADLINE_EXCEEDED without waiting.
            out.append(",\"spent_deadline\":").append(quote(code(() -> client.embed(texts, Duration.ofNanos(1)))));
        }
        try (EmbedcarClient wrong = new EmbedcarClient(target, apiKey + "-not-it")) {
            out.append(",\"wrong_key\":").append(quote(code(() -> wrong.embed(texts, Duration.ofMillis(2000)))));
            out.append(",\"wrong_key_stream\":")
                    .append(quote(code(() -> wrong.embedOnStream(texts, Duration.ofMillis(2000)))));
        }
        System.out.println(out.append('}'));
    }

    private static String code(Runnable call) {
        try {
            call.run();
            return "OK";
        } catch (StatusRuntimeException ex) {
            return ex.getStatus().getCode().name();
        }
    }

    private static String quote(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') {
                b.append('\\').append(c);
            } else if (c < 0x20) {
                b.append(String.format("\\u%04x", (int) c));
            } else {
                b.append(c);
            }
        }
        return b.append('"').toString();
    }
}
